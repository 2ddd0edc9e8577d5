"""The client a job calls its models through, and which model actually serves each role.

A job either talks to a running server (``server_url``) or starts the stack of its serve config for as long as it
runs (:func:`client_for`), then records the models that answered it (:func:`served_models`). Kept apart from
serving/launch.py, which starts stacks (the embedded engine with torch and transformers, its FastAPI app, vLLM): the
data jobs' Ray workers import the job modules to run their work functions and only ever call servers, so importing
a job module must not import the launcher. ``client_for`` imports it when it starts a stack.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

from overstory.models.registry import builtin_name_of
from overstory.serving.client import Client
from overstory.serving.config import ServeConfig, resolve_api_key


@contextmanager
def client_for(serve: ServeConfig, server_url: str | Mapping[str, str] = "", **http_options: Any) -> Iterator[Client]:
    """A client for ``server_url`` when one is given (a URL, a role -> URL mapping or a ``stack.json``), else for
    the stack of ``serve`` started for as long as the block runs; ``http_options`` go to ``Client.from_url``
    (``timeout_s``, ``max_retries``). The one place jobs choose between a running server and their own stack.

    The client sends the stack's API key (``serve.api_key``, else ``$OVERSTORY_API_KEY``: what the stack it starts
    checks, and what a running stack of the same settings checks) unless ``http_options`` name another one."""
    with ExitStack() as stack:
        if server_url:
            url = server_url
        else:
            from overstory.serving.launch import stack_in_background  # only a job that starts a stack loads it

            url = stack.enter_context(stack_in_background(serve))
        client = Client.from_url(url, **{"api_key": resolve_api_key(serve.api_key), **http_options})
        stack.callback(client.close)
        yield client


def served_models(client: Client, roles: list[str] | None = None) -> dict[str, str]:
    """Role -> the model that actually serves it, as its server's ``/v1/models`` says (``roles``: only these).

    A base model reads as its ``root`` (vLLM's model path, the embedded engine's model name; a built-in's cache
    folder as its ``builtin:`` name, so both engines name the same model alike); a LoRA module as
    ``<parent> + <root>`` (the base model, then the adapter's folder), so a record names what answered it even
    when ``server_url`` points at another stack than the job's config describes. Weights served in another dtype
    than float32 (the entry's ``dtype``, which overstory's servers list) add it in brackets,
    ``builtin:qwen2.5-coder-1.5b-instruct (bfloat16)``: their replies may differ from float32's, so a job that kept
    float32 answers refuses to add bfloat16 ones to them. A bare vLLM server lists no dtype: its roles read without one.
    """
    served = {}
    for response in client.backend.get("/v1/models"):
        for entry in response.get("data", []):
            root, parent = entry.get("root") or entry["id"], entry.get("parent")
            name = f"{builtin_name_of(parent)} + {root}" if parent and parent != root else builtin_name_of(root)
            dtype = entry.get("dtype", "float32")
            served[entry["id"]] = name if dtype == "float32" else f"{name} ({dtype})"
    return {role: model for role, model in served.items() if roles is None or role in roles}
