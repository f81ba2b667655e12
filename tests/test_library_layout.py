"""The library's rooms stay the size and shape docs/DESIGN.md §3 draws them (issue 20).

* No file of the library (``cli/``, ``context/``, ``engine/``, ``kernels/``, ``models/``; not
  ``tests/`` or ``bench/``) is over ``MAX_LINES`` lines.
* Nothing in ``engine/`` imports in a circle (lazy imports inside functions count too: a circle
  that only a late import breaks is still one), and no engine module reaches into another's
  private names: it imports no underscore name from ``dynctx``, and reads no underscore
  attribute of anything but ``self``/``cls`` and the third-party modules it imports (``sys``,
  ``torch``): ``engine.step._run()`` or ``self.engine._deliver()`` fail the test.

The checks read the source with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("cli", "context", "engine", "kernels", "models")
MAX_LINES = 500
# Where the import package maps each folder (pyproject.toml's package-dir).
PACKAGE_OF = {"cli": "dynctx", "context": "dynctx.context", "engine": "dynctx.engine",
              "kernels": "dynctx.kernels", "models": "dynctx.models"}


def library_files() -> Iterator[Path]:
    for folder in LIBRARY:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_library_file_is_over_the_line_limit():
    over = {}
    for path in library_files():
        name = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES:
            over[name] = lines
    assert not over, (f"library files over {MAX_LINES} lines (split them by job, "
                      f"CONTRIBUTING.md, Adding a kernel: 1): {over}")


def engine_modules() -> Dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for path in sorted((ROOT / "engine").glob("*.py"))}


def engine_imports(tree: ast.Module) -> Set[str]:
    """The engine modules ``tree`` imports, at any depth (lazy imports included)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:   # from . import x
                    found.update(alias.name for alias in node.names)
            elif node.level == 0 and node.module and node.module.startswith("dynctx.engine"):
                rest = node.module[len("dynctx.engine"):].lstrip(".")
                if rest:
                    found.add(rest.split(".")[0])
                else:
                    found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("dynctx.engine."):
                    found.add(alias.name.split(".")[2])
    return found


def find_circle(graph: Dict[str, Set[str]]) -> List[str]:
    """One import circle of ``graph`` (module -> modules it imports), or [] when it has none."""
    state: Dict[str, str] = {}
    path: List[str] = []

    def visit(module: str) -> List[str]:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                circle = visit(target)
                if circle:
                    return circle
        state[module] = "done"
        path.pop()
        return []

    for module in sorted(graph):
        if module not in state:
            circle = visit(module)
            if circle:
                return circle
    return []


def test_find_circle_sees_circles_and_only_them():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"a"}}) == ["a", "a"]


def test_engine_modules_import_in_no_circle():
    modules = engine_modules()
    graph = {name: engine_imports(tree) - {name} for name, tree in modules.items()}
    unknown = {name: sorted(targets - set(modules)) for name, targets in graph.items()
               if targets - set(modules)}
    assert not unknown, f"engine modules import engine modules that do not exist: {unknown}"
    assert find_circle(graph) == [], f"engine modules import in a circle: {find_circle(graph)}"


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(tree: ast.Module) -> List[str]:
    """Every underscore name of another module or object that ``tree`` uses, as
    ``line: what``."""
    third_party = set()   # names bound to modules outside dynctx (sys, torch, ...)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith("dynctx"):
                    third_party.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            inside = node.level > 0 or (node.module or "").startswith("dynctx")
            for alias in node.names:
                if inside and is_private(alias.name):
                    found.append(f"{node.lineno}: imports {alias.name} from "
                                 f"{'.' * node.level}{node.module or ''}")
                elif not inside:
                    third_party.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            base = node.value
            while isinstance(base, (ast.Attribute, ast.Call, ast.Subscript)):
                base = base.func if isinstance(base, ast.Call) else base.value
            owner = base.id if isinstance(base, ast.Name) else None
            direct = isinstance(node.value, ast.Name)
            if direct and owner in ("self", "cls"):
                continue
            if owner in third_party:
                continue
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_private_uses_sees_reaches_into_other_objects():
    tree = ast.parse("import sys\nfrom . import step\nfrom .results import _deliver\n"
                     "self._mine()\nsys._getframe()\nstep._run()\nself.engine._flush()\n")
    assert private_uses(tree) == ["3: imports _deliver from .results", "6: step._run",
                                  "7: self.engine._flush"]


def test_engine_modules_use_no_private_names_of_others():
    found = {name: uses for name, tree in engine_modules().items()
             if (uses := private_uses(tree))}
    assert not found, f"engine modules reach into private names: {found}"


@pytest.mark.parametrize("folder", LIBRARY)
def test_every_library_folder_holds_python_files(folder):
    # The layout checks above read these folders; an empty glob would make them pass vacuously.
    assert list((ROOT / folder).glob("*.py")), f"{folder}/ has no Python files"
