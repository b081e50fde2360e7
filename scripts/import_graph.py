"""The package's import graph from its source, function-local imports included.

    python scripts/import_graph.py            # package edges, package cycles, file cycles
    python scripts/import_graph.py --local    # also every function-local import, by file

A package is the first name below inkling_fp4 (`train`, `model`, ...; a top-level module such as
`config` counts as its own package). Imports under `if TYPE_CHECKING:` are left out: they never run.
"""

from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"
TOP = "inkling_fp4"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported module, whether inside a function, line) for each import of the package."""
    mod = module_name(path)
    is_pkg = path.name == "__init__.py"
    found: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub, local)
                continue
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == TOP:
                        found.append((alias.name, inner, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = mod.split(".")
                    base = base[: len(base) - child.level + (1 if is_pkg else 0)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target.split(".")[0] != TOP:
                    continue
                for alias in child.names:
                    # `from pkg import module` imports the module; `from module import name` the module
                    sub = f"{target}.{alias.name}"
                    found.append((sub if _is_module(sub) else target, inner, child.lineno))
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return list(dict.fromkeys(found))


def _is_module(name: str) -> bool:
    rel = Path(ROOT, *name.split("."))
    return rel.with_suffix(".py").exists() or (rel / "__init__.py").exists()


def package(mod: str) -> str:
    return mod.split(".")[1]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--local", action="store_true", help="list every function-local import")
    args = ap.parse_args()
    files = sorted((ROOT / TOP).rglob("*.py"))
    pkg_edges: dict[str, set[str]] = defaultdict(set)
    pkg_local: dict[tuple[str, str], int] = defaultdict(int)
    file_edges: dict[str, set[str]] = defaultdict(set)
    local_list: list[str] = []
    for path in files:
        src = module_name(path)
        for target, local, line in imports(path):
            if target == TOP or src == TOP:
                continue
            if target != src and not src.startswith(target + "."):
                file_edges[src].add(target)
            a, b = package(src), package(target)
            if local:
                local_list.append(f"{path.relative_to(ROOT)}:{line}  {target}")
            if a != b:
                pkg_edges[a].add(b)
                pkg_local[(a, b)] += local
    print("package edges (n = function-local imports on that edge):")
    for a in sorted(pkg_edges):
        targets = ", ".join(
            f"{b}" + (f" ({pkg_local[(a, b)]})" if pkg_local[(a, b)] else "") for b in sorted(pkg_edges[a])
        )
        print(f"  {a:10s} -> {targets}")
    print("package cycles:", cycles(pkg_edges) or "none")
    print("file cycles:", cycles(file_edges) or "none")
    print(f"function-local imports of the package: {len(local_list)}")
    if args.local:
        print("\n".join("  " + line for line in local_list))


if __name__ == "__main__":
    main()
