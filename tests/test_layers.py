"""lpbench's layers (ARCHITECTURE.md), checked on the source: no upward import, no import cycle.

Every ``import`` counts, at module level or inside a function. A module may import its own
layer or the ones below; modules of one layer may import each other as long as no cycle forms.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lpbench"
# Bottom to top; a module belongs to the longest prefix that names it.
LAYERS = [
    [
        "lpbench",
        "lpbench.errors",
        "lpbench.console",
        "lpbench.configs",
        "lpbench.threads",
        "lpbench.paths",
        "lpbench.gemm",
        "lpbench.passes",
        "lpbench.parsing",
        "lpbench.sharding",
    ],
    ["lpbench.models", "lpbench.data", "lpbench.corpus", "lpbench.precision", "lpbench.metrics"],
    ["lpbench.convert"],
    ["lpbench.config"],
    ["lpbench.parallel"],
    ["lpbench.train"],
    ["lpbench.bench", "lpbench.report"],
    ["lpbench.cli", "lpbench.__main__"],
]


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under the package folder ``root``."""
    names = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from pkg import sub`` names ``pkg.sub``)."""
    names = module_names(root)
    graph = {}
    for name, path in names.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    here = here[: len(here) - node.level + 1]
                    base = ".".join(here + ([base] if base else []))
                for alias in node.names:
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base)
        graph[name] = {t for t in targets if t in names and t != name}
    return graph


def layer_of(module: str, layers: list[list[str]]) -> int:
    best = max(
        ((len(p), i) for i, group in enumerate(layers) for p in group if module == p or module.startswith(p + ".")),
        default=None,
    )
    if best is None:
        raise KeyError(f"{module} is in no layer: place it in LAYERS (and ARCHITECTURE.md)")
    return best[1]


def upward_imports(graph: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    return sorted(
        f"{m} (layer {layer_of(m, layers)}) imports {t} (layer {layer_of(t, layers)})"
        for m, targets in graph.items()
        for t in targets
        if layer_of(t, layers) > layer_of(m, layers)
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_lpbench_has_no_upward_import():
    assert upward_imports(import_graph(PACKAGE), LAYERS) == []


def test_lpbench_has_no_import_cycle():
    assert cycles(import_graph(PACKAGE)) == []


def test_every_module_has_a_layer():
    for name in module_names(PACKAGE):
        layer_of(name, LAYERS)


def test_the_model_imports_nothing_from_precision():
    """The decoder is plain torch: quantization reaches it only through lpbench.convert."""
    assert imports_between(import_graph(PACKAGE), "lpbench.models", "lpbench.precision") == []


def imports_between(graph: dict[str, set[str]], source: str, target: str) -> list[str]:
    """``module imports module`` for every import from package ``source`` into package ``target``."""

    def inside(name, package):
        return name == package or name.startswith(package + ".")

    return sorted(
        f"{m} imports {t}" for m, targets in graph.items() if inside(m, source) for t in targets if inside(t, target)
    )


def test_cli_is_imported_by_nothing_but_the_entry_point():
    graph = import_graph(PACKAGE)
    assert sorted(m for m, targets in graph.items() if "lpbench.cli" in targets) == ["lpbench.__main__"]


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_check_finds_an_import_between_two_packages():
    graph = {"pkg.models.a": {"pkg.precision.b", "pkg.models.c"}, "pkg.models.c": set(), "pkg.precision.b": set()}
    assert imports_between(graph, "pkg.models", "pkg.precision") == ["pkg.models.a imports pkg.precision.b"]
    assert imports_between(graph, "pkg.precision", "pkg.models") == []


def test_the_check_finds_a_cycle_and_an_upward_import(tmp_path):
    layers = [["pkg", "pkg.low"], ["pkg.high"]]
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "from pkg.low import a\n",
            "pkg/low/a.py": "def f():\n    from . import b\n",  # lazy relative import: still an edge
            "pkg/low/b.py": "from pkg.low.a import f\n",
            "pkg/high/__init__.py": "",
            "pkg/high/c.py": "import pkg.low.b\n",
        },
    )
    graph = import_graph(pkg)
    assert graph["pkg.low.a"] == {"pkg.low.b"} and graph["pkg.high.c"] == {"pkg.low.b"}
    assert cycles(graph) == [["pkg.low.a", "pkg.low.b"]]
    assert upward_imports(graph, layers) == []

    (pkg / "low" / "b.py").write_text("X = 1\n")
    (pkg / "low" / "a.py").write_text("from pkg.high import c\n")  # the bottom reaches up
    graph = import_graph(pkg)
    assert cycles(graph) == []
    assert upward_imports(graph, layers) == ["pkg.low.a (layer 0) imports pkg.high.c (layer 1)"]


def test_a_module_outside_every_layer_is_reported(tmp_path):
    pkg = _write(tmp_path, {"pkg/__init__.py": "", "pkg/stray.py": ""})
    with pytest.raises(KeyError, match="pkg.stray is in no layer"):
        layer_of("pkg.stray", [["pkg.low"]])
    assert set(module_names(pkg)) == {"pkg", "pkg.stray"}
