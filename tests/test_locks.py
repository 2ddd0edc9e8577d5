"""The lock files in requirements/ are what the environments install, and they agree with what the project asks for.

`make env` installs .venv from requirements/venv.lock and requirements/models.lock with --no-deps, so a dependency
added to pyproject.toml without `make lock` would be missing from a fresh install: these tests catch that first.
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.packages import ROOT

LOCKS = ROOT / "requirements"


def locked(lock: str) -> dict[str, Version]:
    """name -> pinned version of every ``name==version`` line of a lock file (local labels like +cpu kept)."""
    pins = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\]+)", (LOCKS / lock).read_text(), re.M)
    return {canonicalize_name(name): Version(version) for name, version in pins}


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_every_requirement_of_the_project_is_locked_at_a_version_it_accepts() -> None:
    pins = locked("venv.lock")
    wanted = [Requirement(line) for line in project()["dependencies"] + project()["optional-dependencies"]["dev"]]
    wrong = [f"{req} (locked: {pins.get(canonicalize_name(req.name), 'missing')})" for req in wanted
             if canonicalize_name(req.name) not in pins
             or not req.specifier.contains(pins[canonicalize_name(req.name)], prereleases=True)]
    assert not wrong, f"run `make lock` after changing pyproject.toml: {wrong}"


def test_the_builtin_models_extra_is_what_the_models_lock_pins() -> None:
    extra = {canonicalize_name(Requirement(line).name): str(Requirement(line).specifier)
             for line in project()["optional-dependencies"]["builtin-models"]}
    pins = {name: f"=={version}" for name, version in locked("models.lock").items()}
    assert extra == pins


def test_this_environment_is_the_lock() -> None:
    """The suite runs in what the lock says: every locked package is installed at its locked version."""
    pins = locked("venv.lock") | locked("models.lock")
    installed = {canonicalize_name(dist.metadata["Name"]): Version(dist.version) for dist in metadata.distributions()}
    differ = {name: (str(version), str(installed.get(name, "missing"))) for name, version in pins.items()
              if installed.get(name) != version}
    assert not differ, f"locked vs installed (rebuild .venv: rm -rf .venv && make env): {differ}"


def test_the_vllm_lock_pins_what_its_input_names() -> None:
    pins = locked("vllm.lock")
    for line in (LOCKS / "vllm.in").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            assert req.specifier.contains(pins[canonicalize_name(req.name)]), (req, pins.get(req.name))
