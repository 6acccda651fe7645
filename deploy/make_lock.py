"""Write deploy/requirements.lock: exact versions of the runtime dependency closure.

Reads `dependencies` from pyproject.toml and pins each requirement, and everything it needs at
run time (extras of our requirements included, markers evaluated for Linux/CPython 3.11, the
container's platform), to the version installed in the current environment:

    .venv/bin/python deploy/make_lock.py            # rewrite the file
    .venv/bin/python deploy/make_lock.py --check    # exit 1 if it would change

The Dockerfile installs the project with `pip install -c deploy/requirements.lock`, so the image
gets the versions the tests ran with. tests/test_deploy.py checks the file is current.
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "deploy" / "requirements.lock"
# The container: python:3.11-slim on Linux x86_64/aarch64.
ENVIRONMENT = {
    "python_version": "3.11",
    "python_full_version": "3.11.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pending = [(Requirement(r), frozenset()) for r in project["dependencies"]]
    pinned: dict[str, str] = {}
    expanded: set[tuple[str, frozenset[str]]] = set()
    while pending:
        requirement, _ = pending.pop()
        name = canonical(requirement.name)
        extras = frozenset(requirement.extras)
        if (name, extras) in expanded:
            continue
        expanded.add((name, extras))
        try:
            dist = distribution(requirement.name)
        except PackageNotFoundError:
            raise SystemExit(
                f"{requirement.name} is not installed: pip install -e '.[test]'"
            ) from None
        pinned[name] = dist.version
        for text in dist.requires or []:
            child = Requirement(text)
            if child.marker is None:
                pending.append((child, frozenset()))
                continue
            for extra in ("", *extras):
                if child.marker.evaluate({**ENVIRONMENT, "extra": extra}):
                    pending.append((child, frozenset()))
                    break
    return pinned


def render() -> str:
    lines = [
        "# Exact versions of prefix-router's runtime dependencies (the Docker image installs",
        "# with `pip install -c deploy/requirements.lock .`). Generated from the tested",
        "# environment by: python deploy/make_lock.py",
    ]
    lines += [f"{name}=={version}" for name, version in sorted(closure().items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        current = LOCK.read_text() if LOCK.exists() else ""
        if current != text:
            print("deploy/requirements.lock is stale: run python deploy/make_lock.py")
            return 1
        return 0
    LOCK.write_text(text)
    print(f"wrote {LOCK.relative_to(REPO)} ({text.count('==')} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
