"""An install puts one import name, ``overstory``, into site-packages, and works from a folder that holds
packages called ``models`` and ``training`` of its own (a user's project)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.packages import ROOT, module_files

pytestmark = pytest.mark.slow
MAIN_MODULES = ["overstory.cli", "overstory.training.stitch", "overstory.training.planner_grpo",
                "overstory.serving.client", "overstory.evaluation.planner", "overstory.data_pipeline.traces",
                "overstory.retrieval.smartchunk", "overstory.models.registry", "overstory.core.config"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(folder)],
                   check=True, cwd=folder)
    return next(folder.glob("overstory-*.whl"))


def test_wheel_has_one_top_level_name(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"overstory", f"{wheel.name.split('-py')[0]}.dist-info"}
    packaged = {name.removesuffix(".py").replace("/", ".").removesuffix(".__init__") for name in names
                if name.endswith(".py")}
    assert packaged == set(module_files())  # every module of the repository's folders, nothing else


def test_installed_wheel_runs_beside_a_users_own_models_and_training(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # the dependencies come from .venv: its site-packages as a plain path entry (its .pth files, among them the
    # editable install of this checkout, are not run, so only the wheel can provide `overstory`)
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True)

    project = tmp_path / "project"
    for name in ("models", "training"):
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text(f"OWNER = 'user {name}'\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    help_text = subprocess.run([venv / "bin" / "overstory", "--help"], cwd=project, env=env, check=True,
                               capture_output=True, text=True).stdout
    assert "data" in help_text and "train" in help_text and "quickstart" in help_text
    probe = ("import importlib, models, training\n"
             f"mods = [importlib.import_module(m) for m in {MAIN_MODULES!r}]\n"
             "print(models.OWNER, training.OWNER, sorted({m.__file__.split('/overstory/')[0] for m in mods}))")
    out = subprocess.run([python, "-c", probe], cwd=project, env=env, check=True, capture_output=True,
                         text=True).stdout.split()
    assert out[:4] == ["user", "models", "user", "training"]  # the user's packages are not shadowed
    assert out[4:] == [f"['{site}']"]  # every overstory module comes from the installed wheel
