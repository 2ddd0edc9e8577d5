"""Every docstring example in the package runs, each module imported by its ``overstory.*`` name (collecting
the folders with --doctest-modules would import them a second time under bare names like ``training``).

Only modules whose source holds an example (a ``>>>`` line) are parameters, found by reading the files so that
collecting this file imports nothing; each such module must really run examples, so a ``>>>`` that doctest does
not see fails rather than passing as an import check. That every module imports is one test of its own."""

from __future__ import annotations

import doctest
import importlib
import re

import pytest

from tests.packages import module_files

FILES = module_files()
EXAMPLE = re.compile(r"^\s*>>> ", re.MULTILINE)
WITH_EXAMPLES = sorted(name for name, path in FILES.items() if EXAMPLE.search(path.read_text()))


def test_some_modules_have_examples() -> None:
    """A change to the pattern that finds no module would leave the parametrised test below with nothing to run."""
    assert len(WITH_EXAMPLES) >= 20, WITH_EXAMPLES


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.attempted > 0, f"{name} has a '>>>' line but doctest found no example in its docstrings"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name} (output above)"


def test_every_module_imports() -> None:
    """Modules without an example are only imported: all in one test, naming each one that fails."""
    failed = {}
    for name in sorted(FILES):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - every failing module is named, not only the first
            failed[name] = f"{type(exc).__name__}: {exc}"
    assert not failed, failed
