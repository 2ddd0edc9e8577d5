"""Dependencies point one way (../shared/DESIGN.md), checked from the code's own import statements.

From the bottom up, a module may import its own part and any part below it, never one above or beside it:

    core            overstory.core: configs, tracking, plots, memory, the sentence splitter, and the records every
                    layer reads and writes (the ground)
    models          what is trained and served
    serving         the engines, the server and the client: the only way the layers above reach a model
    retrieval       the runtime, plus the answer judging and metrics both data jobs and evaluations use
    data_pipeline   the data jobs, which retrieve and answer to label
    training | evaluation | bench   side by side: an evaluation reads checkpoints, never a recipe's code; a
                    benchmark runs recipes as commands, never imports them
    top             overstory.cli, overstory.jobs, overstory.quickstart: may use everything, used by nothing

Imports inside functions count too (a lazy import is still a dependency), except under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast

import pytest

from tests.packages import module_files

LAYERS = [("core",), ("models",), ("serving",), ("retrieval",), ("data_pipeline",),
          ("training", "evaluation", "bench"), ("top",)]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
# the training modules that are recipes (a job of their own): none of them imports another
RECIPES = {"compressor", "text_compressor", "planner_sft", "planner_grpo", "stitch", "verl.export"}


def part_of(module: str) -> str | None:
    """The layer part of an ``overstory.*`` module name (None for anything outside overstory)."""
    pieces = module.split(".")
    if pieces[0] != "overstory":
        return None
    if len(pieces) == 1:
        return "core"  # the package's own __init__ holds nothing
    return pieces[1] if pieces[1] in RANK else "top"


def imported_modules(path) -> list[tuple[int, str]]:
    """(line, module) for every ``import``/``from`` statement outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
               and getattr(block.test, "id", getattr(block.test, "attr", "")) == "TYPE_CHECKING"
               for stmt in block.body for node in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # `from overstory.core import records` names the module in the alias
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names
                      if f"{node.module}.{alias.name}" in module_files()]
    return found


MODULES = module_files()


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name: str) -> None:
    mine = part_of(name)
    wrong = []
    for line, target in imported_modules(MODULES[name]):
        theirs = part_of(target)
        if theirs is None or theirs == mine:
            continue
        if RANK[theirs] >= RANK[mine]:
            wrong.append(f"{MODULES[name].name}:{line} imports {target} ({theirs}, not below {mine})")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipes_do_not_import_each_other(recipe: str) -> None:
    name = f"overstory.training.{recipe}"
    others = {f"overstory.training.{r}" for r in RECIPES} - {name}
    shared = [f"line {line}: {target}" for line, target in imported_modules(MODULES[name]) if target in others]
    assert not shared, f"{recipe} imports another recipe (move what they share to training/common.py): {shared}"


def test_the_checker_catches_an_upward_import(tmp_path) -> None:
    """The checker itself: a retrieval module importing a recipe is reported, a TYPE_CHECKING import is not."""
    module = tmp_path / "bad.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import overstory.cli\n"
                      "def f():\n    from overstory.training.stitch import run\n")
    found = imported_modules(module)
    assert found == [(1, "typing"), (5, "overstory.training.stitch")]
    assert RANK[part_of("overstory.training.stitch")] > RANK[part_of("overstory.retrieval.smartchunk")]
    assert part_of("overstory.cli") == "top" and part_of("overstory.core.config") == "core"


def test_every_folder_with_modules_is_a_declared_package() -> None:
    """A new subfolder (say retrieval/lattice/) that pyproject.toml does not list would be left out of the wheel."""
    from tests.packages import ROOT, package_dirs

    declared = set(package_dirs().values())
    roots = {folder for name, folder in package_dirs().items() if name.count(".") <= 1}
    missing = [str(init.parent.relative_to(ROOT)) for root in roots for init in root.rglob("__init__.py")
               if init.parent not in declared and ".venv" not in init.parts]
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {missing}"


def import_graph() -> dict[str, set[str]]:
    """module -> the overstory modules it imports (lazy imports included), for every module of the namespace."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        targets = {target for _, target in imported_modules(path)}
        # `from overstory.x import y` counts as importing module overstory.x.y when y is a module, else overstory.x
        graph[name] = {t for t in targets if t in MODULES and t != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circles_inside_a_part() -> None:
    """Layers rule out circles between parts; this rules them out inside one (a lazy import still closes one)."""
    circles = import_circles(import_graph())
    assert not circles, "import circles (untie them, moving what both sides need below both):\n" + "\n".join(
        " <-> ".join(circle) for circle in circles)


def test_the_circle_finder_reports_a_circle_and_nothing_else() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []
