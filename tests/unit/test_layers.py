"""The package's shape, read from the source: no imports up the layers, no hand-written
module over 450 lines. Both are rules of the project (STYLE); these tests keep them true.

Layers, bottom up: the domain modules (xllm_py/*.py: config, request, outputs, ...) and the
libraries below the engine (rpc/, parallel/, kv_transfer/, cluster/, model/, utils/, api/)
-> the engine (xllm_py/engine/) -> the master (xllm_service/). A module of a lower layer
imports nothing of a higher one, at module level or inside a function; the types two
layers share live in the lower one.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
BELOW_ENGINE = ("rpc", "parallel", "kv_transfer", "kv_tiers", "cluster", "model", "utils", "api")
MAX_LINES = 450


def _modules(root: pathlib.Path, *dirs: str) -> list[pathlib.Path]:
    return sorted(p for d in dirs for p in (root / d).rglob("*.py")
                  if "proto" not in p.relative_to(root).parts[:2])  # generated stubs


def _imported(root: pathlib.Path, path: pathlib.Path) -> set[str]:
    """Every module `path` imports, relative imports made absolute."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                up = parts[:len(parts) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def _upward(dirs: tuple[str, ...], above: tuple[str, ...],
            root: pathlib.Path = ROOT) -> dict[str, list[str]]:
    found = {}
    for path in _modules(root, *dirs):
        bad = sorted(n for n in _imported(root, path)
                     if any(n == a or n.startswith(a + ".") for a in above))
        if bad:
            found[str(path.relative_to(root))] = bad
    return found


def test_nothing_below_the_engine_imports_the_engine_or_the_master():
    dirs = tuple(f"xllm_py/{d}" for d in BELOW_ENGINE)
    assert _upward(dirs, ("xllm_py.engine", "xllm_service")) == {}, (
        "move the shared type down (e.g. xllm_py/pd_messages.py) instead of importing up")


def test_domain_modules_import_no_layer_above_them():
    found = {}
    for path in sorted((ROOT / "xllm_py").glob("*.py")):
        if path.name in ("launch.py",):  # the launcher starts every process: it is on top
            continue
        bad = sorted(n for n in _imported(ROOT, path)
                     if n.startswith(("xllm_py.engine", "xllm_service")))
        if bad:
            found[path.name] = bad
    assert found == {}


def test_the_engine_imports_no_part_of_the_master():
    assert _upward(("xllm_py/engine",), ("xllm_service",)) == {}


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """The checker itself: a relative and an absolute import up are both found."""
    pkg = tmp_path / "xllm_py" / "rpc"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("from ..engine.pd import scheduler\n")
    (pkg / "b.py").write_text("def f():\n    import xllm_py.engine.llm_engine\n")
    (pkg / "c.py").write_text("from xllm_py.pd_messages import HandOver\n")
    found = _upward(("xllm_py/rpc",), ("xllm_py.engine",), root=tmp_path)
    assert sorted(found) == ["xllm_py/rpc/a.py", "xllm_py/rpc/b.py"]


def test_no_hand_written_module_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules(ROOT, "xllm_py", "xllm_service")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by what they own (at most {MAX_LINES} lines): {long}"
