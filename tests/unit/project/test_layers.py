"""The package's shape, read from the source: imports go down one strict order of packages,
with no circle, and no hand-written module is over 450 lines. Both are rules of the project
(STYLE, docs/DESIGN.md section 2); these tests keep them true.

A node is one of xllm_py's subpackages or top-level modules, or xllm_service (one node).
The entry points (ENTRY_POINTS: modules run as programs, which nothing imports) are nodes
of their own, on top: they pick what the process assembles, as `python -m xllm_py.engine`
picks the simulator's engine with --simulate. Every import counts: at module level, inside
a function, under TYPE_CHECKING. The types two nodes share live in the lower one.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[3]
MAX_LINES = 450

# Bottom first: a node imports only nodes before it.
ORDER = (
    "proto",  # generated stubs
    "xllm_py",  # the package itself (__version__)
    "kv_compat", "outputs", "tls", "structured", "sampling_params", "request",
    "speculative_config", "config",
    "status",  # domain types
    "model",  # models, their config and their split over TP ranks (model/sharding.py)
    "utils",
    "api",  # the OpenAI HTTP layer
    "kv_tiers",
    "cluster",  # etcd, InstanceMeta, latency profiles
    "pd_messages",
    "kv_transfer",  # KV pools, transfer backends, KVWorker
    "rpc",  # the wire layer: pb messages, gRPC clients, the WorkerService servicer
    "parallel",  # TP ranks, every rank's KV worker, InstancePeers
    "engine",
    "xllm_service",
    "sim",  # the simulator: engines built on the engine
    "engine.__main__", "kv_transfer._peer_main", "launch",  # entry points
)
ENTRY_POINTS = ("xllm_py.engine.__main__", "xllm_py.kv_transfer._peer_main", "xllm_py.launch")


def sources(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for d in ("xllm_py", "xllm_service") for p in (root / d).rglob("*.py"))


def hand_written(root: pathlib.Path) -> list[pathlib.Path]:
    return [p for p in sources(root) if "proto" not in p.relative_to(root).parts[:2]]


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def node(module: str) -> str | None:
    """The node of a dotted module name; None outside the two packages."""
    parts = module.split(".")
    if parts[0] == "xllm_service":
        return "xllm_service"
    if parts[0] != "xllm_py":
        return None
    for entry in ENTRY_POINTS:
        if module == entry or module.startswith(entry + "."):
            return entry.removeprefix("xllm_py.")
    return parts[1] if len(parts) > 1 else "xllm_py"


def _imported(root: pathlib.Path, path: pathlib.Path) -> set[str]:
    """Every module `path` imports, relative imports made absolute; `from p import m`
    names p.m where m is a module."""
    package = module_name(root, path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names = set()
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(n, ast.Import):
            names.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - n.level + 1] + ([base] if base else []))
            for a in n.names:
                sub = f"{base}.{a.name}"
                is_module = any((root / sub.replace(".", "/")).with_suffix(s).exists()
                                for s in (".py", ""))
                names.add(sub if is_module else base)
    return names


def imports(root: pathlib.Path = ROOT) -> list[tuple[str, str, str, str]]:
    """(from node, to node, file, module) for each import from one node into another."""
    found = set()
    for path in sources(root):
        src = node(module_name(root, path))
        for module in _imported(root, path):
            dst = node(module)
            if dst is not None and dst != src:
                found.add((src, dst, str(path.relative_to(root)), module))
    return sorted(found)


def upward(edges: list[tuple[str, str, str, str]], order: tuple[str, ...] = ORDER) -> list[str]:
    rank = {n: i for i, n in enumerate(order)}
    return [f"{f} imports {m} ({a} is below {b})" for a, b, f, m in edges
            if a in rank and b in rank and rank[b] > rank[a]]


def circles(edges: list[tuple[str, str, str, str]]) -> list[list[str]]:
    """The node graph's strongly connected components of more than one node."""
    succ: dict[str, set[str]] = {}
    for a, b, _, _ in edges:
        succ.setdefault(a, set()).add(b)
        succ.setdefault(b, set())

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in succ[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reached = {n: reach(n) for n in succ}
    found = {tuple(sorted({n} | {m for m in reached[n] if n in reached[m]}))
             for n in succ if n in reached[n]}
    return sorted(list(c) for c in found)


def test_every_node_has_one_place_in_the_order():
    nodes = {node(module_name(ROOT, p)) for p in sources(ROOT)}
    assert len(set(ORDER)) == len(ORDER)
    assert sorted(nodes - set(ORDER)) == [], "place the new package in ORDER"
    assert sorted(set(ORDER) - nodes) == [], "ORDER names a package that is gone"


def test_imports_only_go_down_the_order():
    assert upward(imports()) == [], (
        "move the shared type down, or the code that assembles up, instead of importing up")


def test_the_import_graph_has_no_circle():
    assert circles(imports()) == []


def test_nothing_imports_an_entry_point():
    assert [f"{f} imports {m}" for _, b, f, m in imports()
            if b in {e.removeprefix("xllm_py.") for e in ENTRY_POINTS}] == []


def test_benchmarks_and_tests_sit_above_the_packages():
    """tests/ may import benchmarks/ (the benchmarks' own tests, the netns lab both use);
    benchmarks/ never imports tests/, and the packages import neither."""
    def importing(paths: list[pathlib.Path], tops: set[str]) -> list[str]:
        return sorted(f"{p.relative_to(ROOT)} imports {m}" for p in paths
                      for m in _imported(ROOT, p) if m.split(".")[0] in tops)

    assert importing(sources(ROOT), {"benchmarks", "tests"}) == []
    assert importing(sorted((ROOT / "benchmarks").rglob("*.py")), {"tests"}) == []


def _tree(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_sees_an_upward_import(tmp_path):
    """Relative, absolute, inside a function and under TYPE_CHECKING: all found; an import
    down is not."""
    root = _tree(tmp_path, {
        "xllm_py/rpc/a.py": "from ..engine.pd import scheduler\n",
        "xllm_py/rpc/b.py": "def f():\n    import xllm_py.engine.llm_engine\n",
        "xllm_py/rpc/c.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from xllm_py.parallel import instance_peers\n"),
        "xllm_py/rpc/d.py": "from xllm_py.pd_messages import HandOver\n",
        "xllm_py/pd_messages.py": "",
        "xllm_py/engine/pd/scheduler.py": "", "xllm_py/engine/llm_engine.py": "",
        "xllm_py/parallel/instance_peers.py": "",
    })
    assert sorted(u.split(" imports ")[0] for u in upward(imports(root))) == [
        "xllm_py/rpc/a.py", "xllm_py/rpc/b.py", "xllm_py/rpc/c.py"]


def test_the_checker_sees_a_circle(tmp_path):
    root = _tree(tmp_path, {
        "xllm_py/cluster/meta.py": "from xllm_py.rpc import cluster\n",
        "xllm_py/rpc/cluster.py": "from xllm_py.pd_messages import HandOver\n",
        "xllm_py/pd_messages.py": "from xllm_py.cluster.meta import Meta\n",
        "xllm_py/config.py": "",
    })
    assert circles(imports(root)) == [["cluster", "pd_messages", "rpc"]]


def test_no_hand_written_module_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in hand_written(ROOT)
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by what they own (at most {MAX_LINES} lines): {long}"
