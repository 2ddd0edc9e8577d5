"""Start the served stack: the embedded server in the foreground (`overstory serve`) or in a background
thread, or, with ``engine: vllm``, vLLM OpenAI servers for the chat roles next to an embedded server for
the rest. The embedded server on the config's ``port`` is then the stack's front door
(``serving/front_door.py``): it answers for every role by model name, so a client with one base URL (the
``openai`` package, LangChain) reaches the whole stack; ``stack.json`` maps role -> the server that runs it.
A served retriever (``overstory serve --retriever DIR``, ``serving/retrieval_routes.py``) is mounted on the
embedded server either way, behind the same key, its index calling the roles through :func:`stack_client`.

    overstory serve --config configs/serve/local.yaml
    overstory serve --config configs/serve/cpu-vllm.yaml      # engine: vllm, one base URL: port 8000

Both claim the listening socket before any model is loaded and hand that same socket to uvicorn,
so a port in use fails at once with a clear message and a free port (``port=0``) cannot be taken
by someone else between choosing it and serving on it.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import uvicorn
from fastapi import FastAPI

from overstory.core.config import ConfigError
from overstory.core.tracking import start_run
from overstory.serving.client import Client, HttpBackend
from overstory.serving.config import ServeConfig, resolve_api_key
from overstory.serving.engine import EmbeddedEngine
from overstory.serving.front_door import create_front_app, mount_front_door
from overstory.serving.in_process import InProcessBackend, in_process_client
from overstory.serving.operations import warn_if_exposed
from overstory.serving.ports import claim_port
from overstory.serving.retrieval_routes import RetrievalService
from overstory.serving.server import create_app
from overstory.serving.vllm import (
    ServerDied,
    log_tail,
    plan_servers,
    require_vllm,
    server_env,
    start_server,
    stop_server,
    vllm_command,
)

logger = logging.getLogger(__name__)

# How long the front door waits for a vLLM server: a whole non-streamed generation, or between two chunks
FRONT_DOOR_TIMEOUT_S = 600.0


# Makes the served retriever over a client of the stack's roles (the top layer's ``overstory/serve.py`` loads it)
MakeRetrieval = Callable[[Client], RetrievalService]


def run(config: ServeConfig, retrieval: MakeRetrieval | None = None) -> None:
    """Serve the roles of ``config`` until Ctrl-C or SIGTERM (from the main thread); the tracking run
    records the served stack when it starts and the uptime when it stops. ``retrieval`` makes the served
    retriever (``serving/retrieval_routes.py``) once the models are loaded, over a client of the roles served
    here: the top layer's ``overstory/serve.py`` passes it for ``config.retriever``, which this layer cannot load
    itself."""
    if config.engine == "vllm":
        return run_vllm_stack(config, retrieval=retrieval)
    warn_if_exposed(config.host, resolve_api_key(config.api_key), logger)
    with claim_port(config.host, config.port) as sock:
        url = f"http://{config.host}:{sock.getsockname()[1]}/v1"
        engine = EmbeddedEngine(config)
        service = retrieval(in_process_client(engine)) if retrieval is not None else None
        server = uvicorn.Server(uvicorn.Config(create_app(engine, service), log_level="info"))
        with start_run(config.tracking, "serve", config) as tracker:
            served = {"retriever": {"folder": config.retriever, "strategy": service.strategy,
                                    "documents": service.document_count()}} if service is not None else {}
            tracker.summary({"url": url, "roles": engine.roles, **served})
            print(f"serving {', '.join(engine.roles)} on {url}", flush=True)
            if service is not None:
                print(f"serving the {service.strategy} retriever of {config.retriever} "
                      f"({service.document_count()} documents) on {url}/retrieve", flush=True)
            started = time.monotonic()
            # uvicorn shuts down gracefully, then re-raises the signal it caught: SIGTERM would kill the
            # process before the tracking run is finished, so it is turned into Ctrl-C's KeyboardInterrupt.
            previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
            try:
                server.run(sockets=[sock])
            except KeyboardInterrupt:
                pass
            finally:
                signal.signal(signal.SIGTERM, previous)
            tracker.summary({"uptime_s": round(time.monotonic() - started, 1)})


@contextmanager
def serve_in_background(source: ServeConfig | EmbeddedEngine | FastAPI, port: int | None = None,
                        host: str | None = None, timeout_s: float = 60.0,
                        configure_app: Callable[[FastAPI], None] | None = None) -> Iterator[str]:
    """Run a server in a daemon thread; yields its base URL (no /v1) once it answers, stops it on exit.

    ``source`` is a serve config (its models are loaded first), a loaded engine, or any ASGI app
    (tests serve deliberately failing apps this way). ``port`` and ``host`` default to the config's
    for a config or engine, and to a free port on 127.0.0.1 for a bare app; ``port=0`` picks a free one.
    ``configure_app`` is called with the app before it serves (the vLLM stack mounts its front door so);
    the server's /health must then answer 200 before this yields, as it must for a config or an engine.
    """
    if isinstance(source, FastAPI):
        default_host, default_port = "127.0.0.1", 0
    else:
        config = source.config if isinstance(source, EmbeddedEngine) else source
        default_host, default_port = config.host, config.port
    host = host or default_host
    # the port is claimed before any model loads; models loaded here (from a config) are released here on exit
    with claim_port(host, default_port if port is None else port) as sock, ExitStack() as owned:
        if isinstance(source, ServeConfig):
            source = owned.enter_context(EmbeddedEngine(source))
        app = source if isinstance(source, FastAPI) else create_app(source)
        if configure_app is not None:
            configure_app(app)
        url = f"http://{host}:{sock.getsockname()[1]}"
        # log_config=None: the server shares the job's process, and uvicorn's default dictConfig would close every
        # logging handler the process has (absl's, imported by rouge-score, then closes the stderr it was made
        # with: under pytest, the capture file of the whole session)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", log_config=None))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"overstory-serve-{url}",
                                  daemon=True)
        thread.start()
        try:
            _wait_until_up(server, thread, url, check_health=app is not source or configure_app is not None,
                           timeout_s=timeout_s)
            yield url
        finally:
            server.should_exit = True
            thread.join(timeout=30)


def _wait_until_up(server: uvicorn.Server, thread: threading.Thread, url: str, check_health: bool,
                   timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server on {url} did not start; see the log above")
        time.sleep(0.02)
    if check_health and httpx.get(f"{url}/health", timeout=10).status_code != 200:
        raise RuntimeError(f"the server on {url} started but /health does not answer 200")


def _visible_gpus() -> int | None:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else None


class VllmStack(NamedTuple):
    roles: dict[str, str]  # role -> URL of the server that runs it (stack.json, for our own client)
    processes: list  # (process, log path) of each vLLM server
    url: str  # the front door: every role on this one base URL (no /v1)
    retriever: RetrievalService | None = None  # the retriever served at the front door's /v1/retrieve


class StackBackend:
    """The backend of a vLLM stack's own client: the embedded roles called in this process through the server's
    handlers (the front server is not up yet when the retriever loads, and needs no socket to itself), the vLLM
    roles over HTTP with the stack's key."""

    def __init__(self, engine: EmbeddedEngine, upstreams: Mapping[str, str], api_key: str | None,
                 timeout_s: float = FRONT_DOOR_TIMEOUT_S):
        self.local = InProcessBackend(engine)
        self.remote = HttpBackend(dict(upstreams), timeout_s=timeout_s, api_key=api_key) if upstreams else None

    def post(self, path: str, payload: dict[str, Any]) -> tuple[dict[str, Any], int]:
        if self.remote is not None and payload.get("model") in self.remote.urls:
            return self.remote.post(path, payload)
        return self.local.post(path, payload)

    def get(self, path: str) -> list[dict[str, Any]]:
        return [*self.local.get(path), *(self.remote.get(path) if self.remote is not None else [])]

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()


@contextmanager
def vllm_stack(config: ServeConfig, retrieval: MakeRetrieval | None = None) -> Iterator[VllmStack]:
    """Start vLLM servers for the chat roles (one per port, LoRA adapters as modules) and the embedded
    server for the other roles, which is also the front door for every role on the config's ``port``;
    yields a :class:`VllmStack` once every server answers /health, and stops them all on exit.
    ``<log_dir>/stack.json`` holds the role -> URL mapping (``Client.from_url(mapping)`` reads it).
    ``retrieval`` (see :func:`run`) gets a :class:`StackBackend` client once the vLLM servers answer; its
    retriever's routes are the embedded server's, behind the same key and in the same error shape."""

    python = require_vllm(config.vllm_python)
    servers, rest = plan_servers(config, available_gpus=_visible_gpus())
    if retrieval is not None and rest is None:
        raise ConfigError(f"retriever={config.retriever}: a served retriever embeds through the stack's embedded "
                          "server, and every role of this stack is a chat role on vLLM; serve roles.embedder too")
    api_key = resolve_api_key(config.api_key)  # the front door checks it; every vLLM server gets it
    warn_if_exposed(config.host, api_key, logger)
    commands = [vllm_command(server, config.host, config.vllm_args, python=python) for server in servers]
    # a taken port fails now, not after minutes of model loading
    for port in [*([config.port] if config.port else []), *(server.port for server in servers)]:
        claim_port(config.host, port).close()
    # the embedded models load before vLLM's, so that a broken embedded role fails in seconds; the front
    # server itself starts last, when its /health (which asks every vLLM server) can answer
    front = EmbeddedEngine(rest) if rest is not None else create_front_app()
    log_dir = Path(config.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    processes: list = []
    upstreams: dict[str, str] = {}
    try:
        with ExitStack() as stack:
            if isinstance(front, EmbeddedEngine):
                stack.callback(front.close)  # last, after its server has stopped (an ExitStack unwinds in reverse)
            for server, command in zip(servers, commands):
                url = f"http://{config.host}:{server.port}"
                log = log_dir / f"vllm-{server.port}.log"
                print(f"starting vLLM for {', '.join(server.roles)} on {url} (log: {log})", flush=True)
                processes.append((start_server(command, url, log, env=server_env(config.vllm_env, api_key)), log))
                upstreams.update({role: url for role in server.roles})
            service = None
            if retrieval is not None and isinstance(front, EmbeddedEngine):
                client = Client(StackBackend(front, upstreams, api_key))
                stack.callback(client.close)
                service = retrieval(client)
            app = create_app(front, service) if isinstance(front, EmbeddedEngine) else front
            door = partial(mount_front_door, upstreams=upstreams, timeout_s=FRONT_DOOR_TIMEOUT_S, api_key=api_key,
                           dtypes={role: config.roles[role].dtype for role in upstreams})
            front_url = stack.enter_context(serve_in_background(app, port=config.port, host=config.host,
                                                                configure_app=door))
            roles = {role: upstreams.get(role, front_url) for role in config.roles}
            (log_dir / "stack.json").write_text(json.dumps(roles, indent=2))
            yield VllmStack(roles, processes, front_url, service)
    finally:
        for process, _ in processes:
            stop_server(process)


@contextmanager
def stack_in_background(config: ServeConfig) -> Iterator[str | dict[str, str]]:
    """The stack a job needs for its roles, on the configured engine, for as long as the job runs: the
    embedded server's URL, or with ``engine: vllm`` the role -> URL mapping of :func:`vllm_stack`. Either
    goes to ``Client.from_url``, so a data job, a reward and an evaluation run unchanged on both engines."""
    if config.engine == "vllm":
        with vllm_stack(config) as stack:
            yield stack.roles
    else:
        with serve_in_background(config) as url:
            yield url


def run_vllm_stack(config: ServeConfig, poll_s: float = 5.0, retrieval: MakeRetrieval | None = None) -> None:
    """``overstory serve`` with ``engine: vllm``: :func:`vllm_stack` until Ctrl-C or SIGTERM, or until a vLLM
    server dies (its log tail is shown)."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with vllm_stack(config, retrieval=retrieval) as stack:
            print(f"serving {', '.join(stack.roles)} on {stack.url}/v1 (every role by model name); role -> server "
                  f"in {Path(config.log_dir) / 'stack.json'}: {json.dumps(stack.roles)}", flush=True)
            if stack.retriever is not None:
                print(f"serving the {stack.retriever.strategy} retriever of {config.retriever} "
                      f"({stack.retriever.document_count()} documents) on {stack.url}/v1/retrieve", flush=True)
            while True:
                for process, log in stack.processes:
                    if process.poll() is not None:
                        raise ServerDied(f"a vLLM server exited with code {process.returncode}; last lines of "
                                         f"{log}:\n{log_tail(log)}")
                time.sleep(poll_s)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
