"""A data job's Ray workers import the job's module to run its work function, and only call servers: the module must
not import torch, transformers, sentence-transformers or the server's FastAPI (each actor held about 200 MB more and
started seconds later when it did). Checked in a fresh interpreter, where nothing else has imported them."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

JOB_MODULES = ("summaries", "traces", "lattice_tree", "lattice_traces", "pseudo_labels", "fable_forest", "orion_tags",
               "ray_runner")
SERVER_SIDE = ("torch", "transformers", "sentence_transformers", "fastapi", "vllm")


def test_the_job_modules_import_nothing_a_worker_does_not_call() -> None:
    """One interpreter imports the modules in turn and records which server-side packages each had loaded after it:
    the first module to pull one in is named."""
    script = (f"import importlib, json, sys\n"
              f"for name in {list(JOB_MODULES)!r}:\n"
              f"    importlib.import_module('overstory.data_pipeline.' + name)\n"
              f"    print(json.dumps([name, [m for m in {list(SERVER_SIDE)!r} if m in sys.modules]]))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = dict(json.loads(line) for line in done.stdout.splitlines() if line.startswith("["))
    assert loaded == {name: [] for name in JOB_MODULES}
