"""Every docstring example in the package runs, each module imported by its ``overstory.*`` name (collecting
the folders with --doctest-modules would import them a second time under bare names like ``training``)."""

from __future__ import annotations

import doctest
import importlib

import pytest

from tests.packages import module_files

MODULES = sorted(module_files())


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name} (output above)"
