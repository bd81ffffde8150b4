"""Generate the Python gRPC stubs under xllm_py/proto/ from protos/*.proto.

Run after editing a .proto: `python scripts/gen_protos.py`.
tests/unit/project/test_protos.py fails when the committed stubs are stale.
"""
from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "xllm_py" / "proto"


def generate(out_dir: pathlib.Path = OUT_DIR) -> list[pathlib.Path]:
    from grpc_tools import protoc
    import grpc_tools

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(PROTO_DIR.glob("*.proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    # grpc_tools writes absolute imports (`import xllm_pb2`); make them package-relative.
    for grpc_file in out_dir.glob("*_pb2_grpc.py"):
        text = grpc_file.read_text()
        text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
        grpc_file.write_text(text)
    return protos


if __name__ == "__main__":
    for p in generate():
        print(f"generated stubs for {p.relative_to(ROOT)}", file=sys.stderr)
