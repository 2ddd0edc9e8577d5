"""Start the embedded server: in the foreground (`overstory serve`) or in a background thread.

    overstory serve --config configs/serve/local.yaml
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn

from serving.config import ServeConfig
from serving.engine import EmbeddedEngine
from serving.server import create_app

log = logging.getLogger(__name__)


class PortInUse(RuntimeError):
    pass


def _claim_port(host: str, port: int) -> int:
    """Check that ``port`` is free on ``host`` (0: find a free one) before any model is loaded."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise PortInUse(f"cannot serve on {host}:{port}: {exc.strerror}; stop the other server or pass "
                            f"port=<another port>") from exc
        return sock.getsockname()[1]


def run(config: ServeConfig) -> None:
    """Serve the roles of ``config`` until Ctrl-C."""
    port = _claim_port(config.host, config.port)
    engine = EmbeddedEngine(config)
    print(f"serving {', '.join(engine.roles)} on http://{config.host}:{port}/v1")
    uvicorn.run(create_app(engine), host=config.host, port=port, log_level="info")


@contextmanager
def serve_in_background(source: ServeConfig | EmbeddedEngine, timeout_s: float = 600.0) -> Iterator[str]:
    """Run the server in a daemon thread; yields its base URL once /health answers, stops it on exit."""
    engine = source if isinstance(source, EmbeddedEngine) else EmbeddedEngine(source)
    config = engine.config
    port = _claim_port(config.host, config.port)
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host=config.host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name=f"overstory-serve-{port}", daemon=True)
    thread.start()
    url = f"http://{config.host}:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the embedded server on {url} did not come up")
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
