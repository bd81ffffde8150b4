"""Counts of the package's shape, for the tree this script runs in (or --root).

    PYTHONPATH=$PWD .venv/bin/python scripts/house_counts.py [--root DIR] [--order FILE]

What it counts, and how:

- Mixin classes: a class of xllm_py/ or xllm_service/ whose name ends in "Mixin", or a
  class of the tree that another class of the tree lists as a base after its first one
  and that defines no __init__ of its own.
- The import graph of tests/unit/project/test_layers.py (this checkout's), read from
  the root's files: xllm_py's subpackages and top-level modules, xllm_service as one
  node, the programs nothing imports (its ENTRY_POINTS) nodes of their own. Every import counts: at
  module level, inside a function, under TYPE_CHECKING. Circles are the strongly connected
  components of more than one node; "imports inside a circle" are the file-level imports
  between two nodes of one circle (no order of the nodes makes them all go down).
- Upward imports: file-level imports from a node to a node later in a strict package
  order (bottom first). The order is the ORDER tuple of --order FILE (default:
  tests/unit/project/test_layers.py of the root) when that file defines one.
- Flags: lines of `python -m X --help` that match ^\\s+-- (grep -cE '^\\s+--').
- Lines of the largest function (def line to last line, decorators excluded) and of the
  largest hand-written module (generated proto stubs excluded).
"""
from __future__ import annotations

import argparse
import ast
import os
import pathlib
import re
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
# The graph test_layers.py checks, read from any tree (--root), so the counts are its own.
from tests.unit.project.test_layers import (  # noqa: E402
    circles, hand_written, imports, module_name, node as node_of)

COMMANDS = (("engine", "xllm_py.engine"), ("service", "xllm_service"), ("launcher", "xllm_py.launch"))


def all_nodes(root: pathlib.Path) -> set[str]:
    return {node_of(module_name(root, p)) for p in hand_written(root)}


def read_order(path: pathlib.Path) -> tuple[str, ...] | None:
    if not path.is_file():
        return None
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "ORDER"):
            return tuple(ast.literal_eval(node.value))
    return None


def mixins(root: pathlib.Path) -> list[str]:
    classes, later_bases = {}, set()
    for path in hand_written(root):
        rel = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.ClassDef):
                has_init = any(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))
                               and b.name == "__init__" for b in node.body)
                classes.setdefault(node.name, []).append((rel, has_init))
                for base in node.bases[1:]:
                    name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                    if name:
                        later_bases.add(name)
    found = []
    for name, defs in classes.items():
        for rel, has_init in defs:
            if name.endswith("Mixin") or (name in later_bases and not has_init):
                found.append(f"{rel}:{name}")
    return sorted(found)


def flags(root: pathlib.Path, module: str) -> int | str:
    env = dict(os.environ, PYTHONPATH=str(root))
    try:
        run = subprocess.run([sys.executable, "-m", module, "--help"], cwd=root, env=env,
                             capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "timeout"
    if run.returncode != 0:
        return f"error (rc {run.returncode})"
    return sum(1 for line in run.stdout.splitlines() if re.match(r"^\s+--", line))


def largest(root: pathlib.Path) -> tuple[tuple[int, str], tuple[int, str]]:
    best_fn, best_mod = (0, ""), (0, "")
    for path in hand_written(root):
        rel = str(path.relative_to(root))
        text = path.read_text()
        best_mod = max(best_mod, (len(text.splitlines()), rel))
        for node in ast.walk(ast.parse(text, rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                best_fn = max(best_fn, (node.end_lineno - node.lineno + 1,
                                        f"{rel}:{node.lineno} {node.name}"))
    return best_fn, best_mod


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="the tree to count (default: .)")
    parser.add_argument("--order", help="a file defining ORDER, the strict package order "
                        "bottom first (default: tests/unit/project/test_layers.py of the root)")
    parser.add_argument("--no-flags", action="store_true", help="skip the --help runs")
    args = parser.parse_args()
    root = pathlib.Path(args.root).resolve()
    head = subprocess.run(["git", "-C", str(root), "describe", "--always", "--tags"],
                          capture_output=True, text=True).stdout.strip()
    print(f"tree: {root} ({head})")

    found = mixins(root)
    print(f"mixin classes: {len(found)}")
    for m in found:
        print(f"  {m}")

    edges = imports(root)
    node_edges = {(a, b) for a, b, _, _ in edges}
    nodes = all_nodes(root) | {b for _, b in node_edges}
    comps = circles(edges)
    inside = [e for e in edges if any(e[0] in c and e[1] in c for c in comps)]
    print(f"import graph: {len(nodes)} nodes, {len(node_edges)} node edges, "
          f"{len(edges)} file-level imports across nodes")
    print(f"import circles: {len(comps)}")
    for c in comps:
        print(f"  circle of {len(c)}: {', '.join(c)}")
    print(f"node edges inside a circle: {sum(1 for a, b in node_edges if any(a in c and b in c for c in comps))}")
    print(f"file-level imports inside a circle: {len(inside)}")
    for a, b, f, m in inside:
        print(f"  {a} -> {b}: {f} imports {m}")

    order_file = pathlib.Path(args.order) if args.order else root / "tests/unit/project/test_layers.py"
    order = read_order(order_file)
    if order is None:
        print(f"upward imports: no strict package order (no ORDER in {order_file})")
    else:
        rank = {n: i for i, n in enumerate(order)}
        unplaced = sorted(n for n in nodes if n not in rank)
        up = [e for e in edges if e[0] in rank and e[1] in rank and rank[e[1]] > rank[e[0]]]
        print(f"package order ({order_file}), bottom first: {', '.join(order)}")
        if unplaced:
            print(f"  nodes not in the order: {', '.join(unplaced)}")
        print(f"upward imports against that order: {len(up)}")
        for a, b, f, m in up:
            print(f"  {a} -> {b}: {f} imports {m}")

    if not args.no_flags:
        for label, module in COMMANDS:
            print(f"flags of python -m {module} --help ({label}): {flags(root, module)}")

    (fn_lines, fn), (mod_lines, mod) = largest(root)
    print(f"largest function: {fn_lines} lines ({fn})")
    print(f"largest hand-written module: {mod_lines} lines ({mod})")


if __name__ == "__main__":
    main()
