"""The package's layers (docs/DESIGN.md §1): a module imports only from its own layer or
the layers below it, and no two modules import each other, directly or around a circle
(module-level or inside a function: a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "kestrel_cli"

# lowest first; a module's layer is that of its longest listed prefix
LAYERS = [
    ("core", "kestrel_cli._kernels"),  # the compiled kernels are a leaf too
    ("formats",),
    ("runtime",),
    ("text",),
    ("models",),
    ("inference",),
    ("apps", "kestrel_cli.cli", "kestrel_cli.server", "kestrel_cli"),
]


def _layer(module: str) -> int:
    best, rank = -1, None
    for i, names in enumerate(LAYERS):
        for n in names:
            full = n if n.startswith("kestrel_cli") else f"kestrel_cli.{n}"
            if (module == full or module.startswith(full + ".")) and len(full) > best:
                best, rank = len(full), i
    assert rank is not None, module
    return rank


def _module_name(path: Path, pkg: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_pkg else parts), is_pkg


def _imports(path: Path, pkg: Path) -> set[str]:
    """The kestrel_cli modules (or packages) that `path` imports."""
    name, is_pkg = _module_name(path, pkg)
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kestrel_cli")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(here[: len(here) - (node.level - 1)])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if not mod.startswith("kestrel_cli"):
                continue
            for a in node.names:  # `from pkg import module`
                sub = f"{mod}.{a.name}"
                p = pkg.parent / Path(*sub.split("."))
                out.add(sub if p.with_suffix(".py").exists() or p.is_dir() else mod)
    return out


def _graph(pkg: Path = PKG) -> dict[str, set[str]]:
    return {_module_name(p, pkg)[0]: _imports(p, pkg) for p in pkg.rglob("*.py")}


def _upward(graph) -> list[str]:
    return [
        f"{mod} (layer {_layer(mod)}) imports {dep} (layer {_layer(dep)})"
        for mod, deps in sorted(graph.items())
        for dep in sorted(deps)
        if _layer(dep) > _layer(mod)
    ]


def _circle(graph) -> list[str]:
    """One import circle, or []. A package importing its own modules (an __init__'s
    re-exports) is not counted: Python imports the package first either way."""
    edges = {
        m: {d for d in deps if d in graph and not d.startswith(m + ".")}
        for m, deps in graph.items()
    }
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> list[str]:
        state[m] = 1
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (found := visit(d, stack + [d])):
                return found
        state[m] = 2
        return []

    for m in sorted(edges):
        if m not in state and (found := visit(m, [m])):
            return found
    return []


def test_every_module_has_a_layer():
    for mod in _graph():
        _layer(mod)


def test_no_module_imports_from_a_layer_above_it():
    bad = _upward(_graph())
    assert not bad, "\n".join(bad)


def test_no_import_circle():
    circle = _circle(_graph())
    assert not circle, "import circle: " + " -> ".join(circle)


def test_the_checks_see_a_violation(tmp_path):
    """The checks can fail: a runtime module importing the engine, which imports it."""
    fake = tmp_path / "kestrel_cli"
    for sub in ("runtime", "inference"):
        (fake / sub).mkdir(parents=True)
        (fake / sub / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "runtime" / "kv.py").write_text("from kestrel_cli.inference import engine\n")
    (fake / "inference" / "engine.py").write_text("from ..runtime import kv\n")
    graph = _graph(fake)
    assert _upward(graph) == [
        "kestrel_cli.runtime.kv (layer 2) imports kestrel_cli.inference.engine (layer 5)"
    ]
    assert _circle(graph) == [
        "kestrel_cli.inference.engine",
        "kestrel_cli.runtime.kv",
        "kestrel_cli.inference.engine",
    ]
