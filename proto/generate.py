"""Generate the Python stubs of proto/tinyloop/v1/tinyloop.proto into tinyloop.client.

    python proto/generate.py             # rewrite client/tinyloop_pb2*.py (make proto)
    python proto/generate.py --out DIR   # write them elsewhere (the staleness test does)

protoc names the grpc module's import of the message module after the .proto file
(`import tinyloop_pb2`); we rewrite it to the package path so the stubs import as
`tinyloop.client.tinyloop_pb2` without touching sys.path.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent
PROTO_DIR = ROOT / "tinyloop" / "v1"
DEFAULT_OUT = ROOT.parent / "client"
STUBS = ("tinyloop_pb2.py", "tinyloop_pb2.pyi", "tinyloop_pb2_grpc.py")


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    import grpc_tools
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out}",
                      f"--pyi_out={out}", f"--grpc_python_out={out}", str(PROTO_DIR / "tinyloop.proto")])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    grpc_file = out / "tinyloop_pb2_grpc.py"
    text = grpc_file.read_text()
    text = text.replace("import tinyloop_pb2 as tinyloop__pb2",
                        "from tinyloop.client import tinyloop_pb2 as tinyloop__pb2")
    grpc_file.write_text(text)
    return [out / name for name in STUBS]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
