"""Ports for the servers a stack starts: claim one now (so a taken port fails before minutes of model loading)
or find a free one. Kept apart from ``launch.py`` so that ``vllm.py`` can pick ports without loading the engine."""

from __future__ import annotations

import socket


class PortInUse(RuntimeError):
    """The configured host:port cannot be bound (another server runs there, or no permission)."""


def claim_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: a free port), not yet listening."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: ignore TIME_WAIT leftovers
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortInUse(f"cannot serve on {host}:{port}: {exc.strerror}; stop the other server or pick another "
                        f"port (overstory serve --config ... port=8001)") from exc
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (for tests that need a dead address)."""
    with claim_port(host, 0) as sock:
        return sock.getsockname()[1]
