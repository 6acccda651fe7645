"""`prefix-router` command line: one subcommand per job, each in its own module.

Subcommand modules are imported lazily so `prefix-router serve` does not pay for the
simulator's or the demo's imports.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name → (module, help). Each module defines add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("extproc.serve", "run the ext_proc gRPC service"),
    "envoy-config": ("extproc.envoyconf", "write an Envoy config for an endpoint list"),
    "config": ("extproc.configcmd", "validate a config file, or print the field reference"),
    "healthcheck": ("extproc.healthcheck", "probe the router's gRPC health service"),
    "fake-replica": ("extproc.fake_replica", "run a stand-in OpenAI-compatible model server"),
    "lab": ("extproc.lab", "real model servers (vLLM on CPU) or stand-ins: up, down, status"),
    "demo": ("extproc.demo", "Envoy + router + stand-in replicas: prefix vs round robin"),
    "bench": (
        "extproc.bench",
        "benchmarks: simulate, grid, core, events, share, latency, overhead, live",
    ),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefix-router", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            importlib.import_module(module_name).add_arguments(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    args = build_parser(only=chosen).parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
