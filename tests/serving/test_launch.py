"""`overstory serve` as users start it, and a clear error when the port is taken."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from overstory.core.config import ConfigError
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.launch import PortInUse, free_port, run, serve_in_background

ROOT = Path(__file__).resolve().parents[2]


def test_port_in_use_fails_before_loading_models() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.perf_counter()
        with pytest.raises(PortInUse, match=f"127.0.0.1:{port}"):
            run(ServeConfig.local(port=port))
        with pytest.raises(PortInUse, match="stop the other server"), serve_in_background(ServeConfig.local(port=port)):
            pass
        assert time.perf_counter() - started < 2  # no model was loaded


def test_bad_serve_configs_name_the_key() -> None:
    with pytest.raises(ConfigError, match="roles.writer: unknown role"):
        ServeConfig(roles={"writer": RoleConfig(model="x")})
    with pytest.raises(ConfigError, match="roles.embedder.kind must be 'embedding'"):
        ServeConfig(roles={"embedder": RoleConfig(model="x")})


@pytest.mark.slow
def test_overstory_serve_command(tmp_path: Path) -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "overstory.cli", "serve", "--config", str(ROOT / "configs/serve/local.yaml"),
         f"port={port}", f"tracking.dir={tmp_path}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
            "model": "generator", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).json()
        assert reply["usage"]["completion_tokens"] > 0
    finally:
        process.terminate()
        output = process.communicate(timeout=30)[0]
    assert process.returncode == 0 and f"on http://127.0.0.1:{port}/v1" in output and "Traceback" not in output
    summary = json.loads(next(tmp_path.glob("serve-*/summary.json")).read_text())
    assert summary["roles"] == ["generator", "planner", "scorer", "embedder"] and summary["uptime_s"] > 0
