"""The overstory namespace as pyproject.toml declares it: every package and its folder in the repository.

Shared by the packaging, layering and doctest tests, so all three look at the same list of modules.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_dirs() -> dict[str, Path]:
    """``overstory.<part>`` -> its folder, from ``[tool.setuptools]`` packages and package-dir."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setuptools["package-dir"]
    dirs = {}
    for package in setuptools["packages"]:
        root = max((name for name in mapping if package == name or package.startswith(name + ".")), key=len)
        dirs[package] = ROOT / mapping[root] / Path(*package[len(root) + 1:].split(".") if package != root else ())
    return dirs


def module_files() -> dict[str, Path]:
    """Every module of the namespace (``overstory.training.stitch`` -> ``training/stitch.py``)."""
    modules = {}
    for package, folder in package_dirs().items():
        for path in sorted(folder.glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules
