"""The package's import graph: no cycle between modules (imports inside functions included: they
run too), and every import goes down the layers of docs/design.md, never back up."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import miles_multilora

ROOT = Path(miles_multilora.__file__).parent

# package -> layer; an import may only name a package of a lower layer (or its own package)
LAYERS = {
    **dict.fromkeys(
        ("errors", "child_process", "disk_usage", "host_tensors", "private_files", "third_party_noise",
         "_triton"), 0,
    ),
    **dict.fromkeys(("algo", "api_token", "child_main"), 1),
    "config": 2,
    **dict.fromkeys(("http_serving", "lora", "models", "data"), 3),
    **dict.fromkeys(("optim", "scoring"), 4),
    "rollout": 5,
    **dict.fromkeys(("trainer", "controller"), 6),
    **dict.fromkeys(("rl", "tinker"), 7),
    **dict.fromkeys(("launch", "testing"), 8),
    "cli": 9,
    "__main__": 10,
}  # fmt: skip


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("miles_multilora", *path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The package modules ``name`` imports at run time (``if TYPE_CHECKING:`` blocks left out)."""

    def walk(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child
            yield from walk(child)

    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: set(imports(name, path, known)) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def package_of(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def test_no_import_cycle_between_modules_even_at_run_time():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_import_goes_down_the_layers():
    edges = graph()
    unplaced = sorted({package_of(m) for m in edges} - set(LAYERS) - {"__init__"})
    assert not unplaced, f"place these packages in LAYERS (and docs/design.md): {unplaced}"
    upward = sorted(
        f"{a} -> {b}"
        for a, targets in edges.items()
        for b in targets
        if package_of(a) != package_of(b)
        and package_of(b) != "__init__"
        and LAYERS[package_of(b)] >= LAYERS.get(package_of(a), 0)
    )
    assert upward == []
