"""Where a role's model runs: the ``device`` setting, checked when the config is read and resolved at load."""

from __future__ import annotations

import pytest
import torch

from overstory.core.config import ConfigError
from overstory.models.registry import SMOLLM2, resolve_device
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.engine import EmbeddedEngine, keep_decoding_off_cudnn_attention


@pytest.mark.parametrize("device", ["cpu", "auto", "cuda", "cuda:1"])
def test_device_names_that_are_accepted(device: str) -> None:
    assert RoleConfig(model=SMOLLM2, device=device).device == device


@pytest.mark.parametrize("device", ["gpu", "cuda:", "CUDA", "mps"])
def test_other_device_names_are_refused(device: str) -> None:
    with pytest.raises(ConfigError, match="device must be cpu, cuda, cuda:N or auto"):
        RoleConfig(model=SMOLLM2, device=device)


@pytest.mark.parametrize("kind", ["compression", "cross-encoder"])
def test_roles_that_run_on_the_cpu_refuse_a_gpu(kind: str) -> None:
    with pytest.raises(ConfigError, match=f"device=cuda is for chat and embedding roles; a {kind} role"):
        RoleConfig(model="runs/x", kind=kind, device="cuda")


@pytest.mark.parametrize("kind", ["embedding", "compression", "cross-encoder"])
def test_only_chat_roles_take_another_dtype(kind: str) -> None:
    """The engine loads only chat models in a role's dtype; the others always run in float32, which is what their
    /v1/models entries list and their records name."""
    with pytest.raises(ConfigError, match=f"dtype=bfloat16 is for chat roles; a {kind} role runs in float32"):
        RoleConfig(model="runs/x", kind=kind, dtype="bfloat16")
    assert RoleConfig(model="runs/x", kind=kind).dtype == "float32"
    assert RoleConfig(model=SMOLLM2, dtype="bfloat16").dtype == "bfloat16"


def test_auto_is_the_gpu_when_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:1") == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(RuntimeError, match="device=cuda but torch sees no GPU"):
        resolve_device("cuda")


def test_an_auto_role_loads_and_answers_on_the_device_torch_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine the suite runs on has no GPU (CI), so auto loads the model on the CPU and it answers."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = ServeConfig(port=0, roles={"generator": RoleConfig(model=SMOLLM2, device="auto")})
    with EmbeddedEngine(config) as engine:
        assert engine.batcher("generator").model.device.type == "cpu"
        result = engine.chat("generator", [{"role": "user", "content": "Count: one, two,"}], max_tokens=3)
        assert result.completion_tokens == 3 and result.choices[0].text


def test_a_chat_model_on_cuda_keeps_decoding_off_cudnn_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN attention builds a plan per input shape, which decoding never repeats (bf16 ran 2-3x slower than
    float32 on an H100): a CUDA chat role turns that backend off; a CPU role leaves the flag alone."""
    flags = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", flags.append)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: not flags or flags[-1])
    assert keep_decoding_off_cudnn_attention("cpu") is False and flags == []
    assert keep_decoding_off_cudnn_attention("cuda:0") is True and flags == [False]
    assert keep_decoding_off_cudnn_attention("cuda") is False and flags == [False]
