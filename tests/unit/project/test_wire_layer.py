"""One wire layer: only xllm_py/rpc/ (and the generated xllm_py/proto/) builds or reads pb
messages. Elsewhere a pb2 module may name types in annotations, and xllm_pb2_grpc may make
calls and register servicers; everything else goes through xllm_py.rpc."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[3]
ALLOWED = (ROOT / "xllm_py" / "rpc", ROOT / "xllm_py" / "proto")
# Methods only pb messages have: calling one outside rpc/ reads or writes the wire form.
PB_METHODS = {"HasField", "WhichOneof", "ListFields", "SerializeToString", "FromString",
              "ParseFromString", "CopyFrom", "MergeFrom", "ClearField"}


def _sources() -> list[pathlib.Path]:
    files = []
    for top in ("xllm_py", "xllm_service"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if not any(path.is_relative_to(a) for a in ALLOWED):
                files.append(path)
    return files


def _pb_aliases(tree: ast.AST) -> set[str]:
    """Names bound to the xllm_pb2 module (not xllm_pb2_grpc)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "xllm_py.proto":
            names |= {a.asname or a.name for a in node.names if a.name == "xllm_pb2"}
        elif isinstance(node, ast.Import):
            names |= {a.asname for a in node.names
                      if a.name == "xllm_py.proto.xllm_pb2" and a.asname}
    return names


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def wire_uses(source: str) -> list[str]:
    """Each call in `source` that builds or reads a pb message: `pb.X(...)` (also
    `pb.Enum.Value(...)`) through a name bound to xllm_pb2, or a pb-only method."""
    tree = ast.parse(source)
    aliases = _pb_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if _root_name(node.func) in aliases or node.func.attr in PB_METHODS:
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}(...)")
    return found


def test_the_scan_finds_what_it_looks_for():
    src = ("from xllm_py.proto import xllm_pb2 as pb\n"
           "def f(m: pb.Status) -> pb.Status:\n"
           "    m.HasField('kv')\n"
           "    pb.InstanceType.Value('MIX')\n"
           "    return pb.Status(ok=True)\n")
    assert sorted(u.split(": ")[1] for u in wire_uses(src)) == [
        "m.HasField(...)", "pb.InstanceType.Value(...)", "pb.Status(...)"]
    assert wire_uses("from xllm_py.proto import xllm_pb2_grpc as pb_grpc\n"
                     "pb_grpc.XllmRpcServiceStub(None)\n") == []


def test_no_module_outside_rpc_builds_or_reads_pb_messages():
    offenders = {str(p.relative_to(ROOT)): uses for p in _sources()
                 if (uses := wire_uses(p.read_text()))}
    assert offenders == {}, ("build/read pb messages in xllm_py/rpc/ and call it from here: "
                             f"{offenders}")
