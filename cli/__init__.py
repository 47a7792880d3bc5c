"""The `tinyloop` command (`python -m tinyloop.cli` works too). Each package registers its own subcommands; a module listed here
must import nothing heavy at import time (torch, ray, grpc load inside the handlers), so
`tinyloop --help` and the wire-only commands stay fast."""
from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "tinyloop.worker.cli",    # generate (in-process), init-model
    "tinyloop.train.cli",     # train, eval-bpb
    "tinyloop.gateway.cli",   # serve
    "tinyloop.client.cli",    # resume, info (and generate --server)
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinyloop", description="Serve weight-shared looped transformers.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args) or 0
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"tinyloop {args.command}: error: {e}", file=sys.stderr)
        return 2

