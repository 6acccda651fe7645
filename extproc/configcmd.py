"""`prefix-router config`: check a configuration, or print the reference table.

`--check FILE` validates exactly as `serve` does at start-up (file, then environment) and
prints the resolved configuration, so a broken file is caught before a rollout.
`--reference` prints the Markdown table in the README (a test keeps the two identical).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml
from pydantic import BaseModel

from .config import Config, ConfigError, load_config


def _fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any, str]]:
    rows = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += _fields(annotation, f"{prefix}{name}.")
            continue
        default = info.default
        if isinstance(default, tuple):
            default = ", ".join(str(v) for v in default) if default else "(none)"
        rows.append((prefix + name, default, info.description or ""))
    return rows


def reference_markdown() -> str:
    lines = ["| field | default | meaning |", "|---|---|---|"]
    for name, default, description in _fields(Config):
        lines.append(f"| `{name}` | `{default}` | {description} |")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--check", metavar="FILE", help="validate FILE (+ environment)")
    group.add_argument("--reference", action="store_true", help="print the field reference")


def run(args: argparse.Namespace) -> int:
    if args.reference:
        sys.stdout.write(reference_markdown())
        return 0
    try:
        config = load_config(args.check)
        if config.cache_events.enabled:  # the model files, as serve checks them
            from .cache_events import translation_from_config

            translation = translation_from_config(config)
            print(f"cache_events: {translation.describe()}", file=sys.stderr)
    except ConfigError as exc:
        print(f"prefix-router: invalid configuration\n{exc}", file=sys.stderr)
        return 2
    sys.stdout.write(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return 0
