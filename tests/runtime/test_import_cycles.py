"""`kvq/runtime` has no import cycle but a kernel's torch/Triton pair (a torch module that imports its Triton
twin at call time, and the twin that imports the torch module's reference): every import statement counts,
at module level, in a function or under TYPE_CHECKING, as the source says it (no module is imported here)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvq

PACKAGE = Path(kvq.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, name: str) -> set[str]:
    """Every module name `path`'s import statements name (`from a import b`: a and a.b)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def runtime_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    runtime = {m for m in modules if m.startswith("kvq.runtime")}
    return {m: (imports(modules[m], m) & runtime) - {m} for m in runtime}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def is_torch_triton_pair(component: list[str]) -> bool:
    if len(component) != 2:
        return False
    torch_side, triton_side = sorted(component, key=lambda m: ".triton." in m)
    return ".triton." not in torch_side and triton_side.rpartition(".")[2] == torch_side.rpartition(".")[2]


def test_the_only_cycles_are_kernel_torch_triton_pairs() -> None:
    found = cycles(runtime_graph())
    assert [c for c in found if not is_torch_triton_pair(c)] == []


def test_a_cycle_is_found() -> None:
    """The check itself: a made-up back-arrow closes a cycle it reports."""
    graph = runtime_graph()
    graph["kvq.runtime.kv_pool"] = graph["kvq.runtime.kv_pool"] | {"kvq.runtime.engine"}
    assert any({"kvq.runtime.kv_pool", "kvq.runtime.engine"} <= set(c) for c in cycles(graph))
