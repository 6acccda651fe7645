"""Docs that must not drift from the code."""

import os
import re
from pathlib import Path

from extproc.config import Config
from extproc.configcmd import _fields, reference_markdown
from extproc.sim import current

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_config_reference_in_readme_matches_the_code():
    match = re.search(
        r"<!-- config-reference:start[^>]*-->\n(.*?)<!-- config-reference:end -->", README, re.S
    )
    assert match, "README lost its config-reference markers"
    assert match.group(1) == reference_markdown(), (
        "regenerate: prefix-router config --reference, paste between the markers"
    )


def test_benchmark_figures_at_the_top_are_the_reference_files():
    """docs/benchmarks.md opens with figures rendered from the reference runs' JSON: a rerun
    that changes a file, or a hand edit of the section, fails here until regenerated."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    regenerated = current.replace_section(text, current.render(ROOT))
    assert regenerated == text, "regenerate: ./scripts/update-docs"
    for head in current.HEADLINES:
        assert (ROOT / "docs" / head.plot).is_file(), head.plot


def test_every_config_field_says_what_it_means():
    """The reference table is the operator's manual: a field without a description is a
    blank row in it."""
    blank = [name for name, _, description in _fields(Config) if not description.strip()]
    assert blank == [], f"config fields without a description: {blank}"


def test_quick_start_is_two_commands_that_exist():
    block = README.split("## Quick start", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands == ["./scripts/demo", "./scripts/test"]
    for command in commands:
        assert os.access(ROOT / command, os.X_OK)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/test" in ci
