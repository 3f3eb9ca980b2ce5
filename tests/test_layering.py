"""The one layering rule (docs/architecture.md): a package imports only packages below it, and
no two modules import each other, even through others. Every import counts: at the top of a
module, inside a function, or for type checking only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import shardwise

PACKAGE = Path(shardwise.__file__).parent

# Bottom to top. A name is a subpackage or a top-level module; "shardwise" is the package's own
# `__init__`: the `sw.*` facade, which gathers the public parts (the trainer's among them) for
# users' scripts and the benchmarks, and which nothing below it imports.
LAYERS = [
    "arguments",
    "comm",
    "distributed",
    "nn",
    "optim",
    "faults",
    "data",
    "observe",
    "strategies",
    "checkpoint",
    "recipes",
    "ps",
    "user_code",
    "job_sections",
    "config",
    "jobs",
    "api",
    "plan",
    "train",
    "launch",
    "shardwise",
    "bench",
    "cli",
    "entry",
    "__main__",
]


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = ["shardwise", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The shardwise modules `path` (module `name`) imports, wherever the import statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up `level - 1` packages
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            for alias in node.names:  # `from package import module` imports the module
                child = f"{base}.{alias.name}"
                found.add(child if child in known else base)
    return {m for m in found if m == "shardwise" or m.startswith("shardwise.")}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    return {name: imports(path, name, set(files)) for name, path in files.items()}


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "shardwise"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    bad = []
    for module, targets in graph.items():
        for target in sorted(targets):
            if layer_of(target) == layer_of(module):
                continue
            if rank[layer_of(target)] > rank[layer_of(module)]:
                bad.append(f"{module} imports {target}: {layer_of(target)} is above it")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle between modules, found by a depth-first search (one per back edge)."""
    found, state = [], {}  # state: 1 on the path, 2 done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if target == module:
                continue
            if state.get(target) == 1:
                found.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_every_package_has_a_layer_and_a_docstring():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert packages | modules | {"shardwise"} == set(LAYERS)
    for package in packages:
        docstring = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text()))
        assert docstring and docstring.split("\n\n")[0].count("\n") == 0, package  # a summary line


def test_no_package_imports_one_above_it():
    assert upward_imports(import_graph()) == []


def test_no_import_cycle_between_modules():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize(
    "violation, complaint",
    [
        ("from shardwise.train.trainer import train", "imports shardwise.train.trainer"),
        ("def f():\n    from shardwise.plan import steptime", "imports shardwise.plan.steptime"),
    ],
)
def test_the_rule_catches_an_upward_import(tmp_path, violation, complaint):
    """The checks themselves fail on a violation: a copy of the package with one added."""
    copy = tmp_path / "shardwise"
    for path in PACKAGE.rglob("*.py"):
        (copy / path.relative_to(PACKAGE)).parent.mkdir(parents=True, exist_ok=True)
        (copy / path.relative_to(PACKAGE)).write_text(path.read_text())
    (copy / "comm" / "collectives.py").write_text(
        (copy / "comm" / "collectives.py").read_text() + "\n" + violation + "\n"
    )
    bad = upward_imports(import_graph(copy))
    assert len(bad) == 1 and complaint in bad[0]
    assert cycles(import_graph(copy))  # and the stack above comm imports comm: a cycle too
