"""Generate the Python stubs of the project's protos.

    proto/tinyloop/v1/tinyloop.proto         -> tinyloop.client.tinyloop_pb2*        (the public API)
    proto/tinyloop/worker/v1/channel.proto   -> tinyloop.worker.serving.channel_pb2* (gateway -> worker)

    python proto/generate.py             # rewrite the committed stubs (make proto)
    python proto/generate.py --out DIR   # write them all into DIR instead (the staleness test does)

protoc names the grpc module's import of the message module after the .proto file
(`import tinyloop_pb2`), and the message classes' module too; we rewrite both to the package
path, so the stubs import as `tinyloop.client.tinyloop_pb2` without touching sys.path and a
message pickles by reference to its class.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent
REPO = ROOT.parent


@dataclass(frozen=True)
class Stubs:
    proto: pathlib.Path  # the .proto file
    out: pathlib.Path    # the committed stubs' directory
    package: str         # the package they import as
    grpc: bool = True    # a gRPC service inside: its *_pb2_grpc.py too

    @property
    def name(self) -> str:
        return self.proto.stem

    @property
    def files(self) -> tuple[str, ...]:
        return (f"{self.name}_pb2.py", f"{self.name}_pb2.pyi") + ((f"{self.name}_pb2_grpc.py",) if self.grpc else ())


PROTOS = (
    Stubs(ROOT / "tinyloop" / "v1" / "tinyloop.proto", REPO / "client", "tinyloop.client"),
    Stubs(ROOT / "tinyloop" / "worker" / "v1" / "channel.proto", REPO / "worker" / "serving",
          "tinyloop.worker.serving", grpc=False),
)


def generate_one(stubs: Stubs, out: pathlib.Path) -> list[pathlib.Path]:
    import grpc_tools
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(["protoc", f"-I{stubs.proto.parent}", f"-I{include}", f"--python_out={out}",
                      f"--pyi_out={out}", *([f"--grpc_python_out={out}"] if stubs.grpc else []), str(stubs.proto)])
    if rc != 0:
        raise RuntimeError(f"protoc failed on {stubs.proto.name} with exit code {rc}")
    module = f"{stubs.name}_pb2"
    if stubs.grpc:
        grpc_file = out / f"{stubs.name}_pb2_grpc.py"
        alias = module.replace("_", "__")
        text = grpc_file.read_text()
        text = text.replace(f"import {module} as {alias}", f"from {stubs.package} import {module} as {alias}")
        grpc_file.write_text(text)
    # the message classes' __module__ is the name protoc was given; the package path makes them
    # importable by name, so a message pickles (a Ray call's argument) by reference to its class
    msg_file = out / f"{module}.py"
    text = msg_file.read_text()
    text = text.replace(f"(DESCRIPTOR, '{module}', _globals)", f"(DESCRIPTOR, '{stubs.package}.{module}', _globals)")
    msg_file.write_text(text)
    return [out / name for name in stubs.files]


def generate(out: pathlib.Path | None = None) -> list[tuple[pathlib.Path, pathlib.Path]]:
    """(fresh stub, committed stub) for every stub file; into `out` when given, else in place."""
    pairs = []
    for stubs in PROTOS:
        for fresh in generate_one(stubs, out or stubs.out):
            pairs.append((fresh, stubs.out / fresh.name))
    return pairs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    for path, _ in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
