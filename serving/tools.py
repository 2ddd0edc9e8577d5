"""OpenAI tool calling for the embedded engine, as pure functions the engine and server wire in.

A chat request may carry ``tools`` and ``tool_choice`` ("auto", "none", "required" or
``{"type": "function", "function": {"name": ...}}``), and its history may hold assistant ``tool_calls`` and
``role: "tool"`` results. Four steps, each here:

- ``validate_tools``: reject malformed tools / tool_choice with a ``BadRequest`` naming the field (a 400).
- ``render_chat_prompt``: the prompt text. A chat template that knows tools renders them itself; one that
  does not (the built-in SmolLM2's renders only role and content) gets the tools and one call syntax, Hermes
  style (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), stated in the system message, and
  past calls and results written in that same syntax, so the model sees one convention throughout.
- ``tool_call_schema``: when a call is forced ("required" or a named function) the decoder is constrained
  (xgrammar, elsewhere) to this JSON schema, so the whole reply is one ``{"name", "arguments"}`` object.
- ``parse_reply``: the model's text back into OpenAI ``tool_calls``. It never raises: a small model writes
  broken blocks, and a broken block is returned as text (and counted) rather than failing the request.

``tool_choice`` "none" leaves the tools out of the prompt (vLLM keeps them unless started with
``--exclude-tools-when-tool-choice-none``): a model shown tools it may not call tends to write calls anyway,
which would then come back as text. The history's calls and results are still rendered. The caller does not
parse replies under "none", and returns ``finish_reason`` "tool_calls" whenever ``ParsedReply.tool_calls``
is non-empty (OpenAI's convention), else the usual "stop"/"length".
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from overstory.serving.errors import BadRequest

TOOL_CHOICES = ("auto", "none", "required")
ROLES = ("system", "user", "assistant", "tool")
# OpenAI's rule for function names; it also keeps names safe inside JSON pointers and prompts.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


# ---------------------------------------------------------------------------------------------- validation


def validate_tools(tools: list[dict] | None, tool_choice: str | dict | None) -> None:
    """Raise ``BadRequest`` (with ``param`` set) unless ``tools`` and ``tool_choice`` are a valid OpenAI pair.

    Each tool is ``{"type": "function", "function": {"name", "description"?, "parameters"?}}`` with a unique
    name (letters, digits, ``_``, ``-``; at most 64) and, if given, ``parameters`` a JSON Schema for an object.
    "auto" and "none" (and no tool_choice) are fine without tools; "required" and a named function are not.

    >>> tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    >>> validate_tools([tool], {"type": "function", "function": {"name": "add"}})
    >>> try:
    ...     validate_tools([tool], {"type": "function", "function": {"name": "mul"}})
    ... except BadRequest as exc:
    ...     print(exc.param, "-", exc)
    tool_choice.function.name - tool_choice names function 'mul', which is not among the tools
    """
    names = _validate_tool_list(tools)
    if tool_choice is None or tool_choice in ("auto", "none"):
        return
    if isinstance(tool_choice, str):
        if tool_choice != "required":
            raise BadRequest(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function, "
                             f"not {tool_choice!r}", param="tool_choice")
        if not names:
            raise BadRequest('tool_choice "required" needs tools', param="tool_choice")
        return
    name = _named_choice(tool_choice)
    if not names:
        raise BadRequest("tool_choice names a function but the request has no tools", param="tool_choice")
    if name not in names:
        raise BadRequest(f"tool_choice names function {name!r}, which is not among the tools",
                         param="tool_choice.function.name")


def _validate_tool_list(tools: Any) -> list[str]:
    """The tools' names, in order, after checking each tool; raises BadRequest."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list of function tools", param="tools")
    names: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise BadRequest(f'{where} must be {{"type": "function", "function": {{...}}}}', param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise BadRequest(f"{where}.function must be an object with a name", param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise BadRequest(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', not {name!r}",
                             param=f"{where}.function.name")
        if name in names:
            raise BadRequest(f"two tools are named {name!r}", param=f"{where}.function.name")
        names.append(name)
        if "description" in function and not isinstance(function["description"], str):
            raise BadRequest(f"{where}.function.description must be a string", param=f"{where}.function.description")
        if "parameters" in function:
            _check_parameters(function["parameters"], f"{where}.function.parameters")
    return names


def _check_parameters(parameters: Any, where: str) -> None:
    # Arguments are always a JSON object, so the schema must describe one (as OpenAI requires); a schema
    # without a "type" is taken as an object schema and tool_call_schema says so explicitly.
    if not isinstance(parameters, dict):
        raise BadRequest(f"{where} must be a JSON Schema object", param=where)
    try:
        validator_for(parameters).check_schema(parameters)
    except SchemaError as exc:
        raise BadRequest(f"{where} is not a valid JSON Schema: {exc.message}", param=where) from None
    if parameters.get("type", "object") != "object":
        raise BadRequest(f'{where} must describe an object ("type": "object"), not {parameters["type"]!r}',
                         param=where)


def _named_choice(tool_choice: Any) -> str:
    """The function name of a ``{"type": "function", "function": {"name": ...}}`` tool_choice."""
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(function, dict):
        raise BadRequest('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                         '{"name": ...}}', param="tool_choice")
    if not isinstance(function.get("name"), str):
        raise BadRequest("tool_choice.function.name must be a string", param="tool_choice.function.name")
    return function["name"]


# ------------------------------------------------------------------------------------------ forced calls


def forces_a_call(tool_choice: str | dict | None) -> bool:
    """Whether ``tool_choice`` forces a tool call ("required" or a named function), so that the reply was
    constrained to ``tool_call_schema``.

    >>> forces_a_call("required"), forces_a_call({"type": "function", "function": {"name": "now"}})
    (True, True)
    >>> forces_a_call("auto"), forces_a_call(None)
    (False, False)
    """
    return tool_choice is not None and tool_choice not in ("auto", "none")


def tool_call_schema(tools: list[dict], tool_choice: str | dict | None) -> dict | None:
    """The JSON schema the reply is constrained to when tool_choice forces a call, else None.

    Named function: ``{"name": {"const": name}, "arguments": <its parameters>}``, both required, nothing else;
    "required": ``anyOf`` one such object per tool. Parameters that use local ``$ref``s (pydantic's ``$defs``)
    are moved under the root's ``$defs`` with their refs rebased, since a ref resolves against the root.

    >>> tools = [{"type": "function", "function": {"name": "now"}}]
    >>> tool_call_schema(tools, "required")["anyOf"][0]["properties"]
    {'name': {'const': 'now'}, 'arguments': {'type': 'object'}}
    >>> tool_call_schema(tools, "auto") is None
    True
    """
    if not forces_a_call(tool_choice):
        return None
    functions = {t["function"]["name"]: t["function"] for t in tools or []}
    if tool_choice == "required":
        if not functions:
            raise BadRequest('tool_choice "required" needs tools', param="tool_choice")
        picked = list(functions.values())
    else:
        name = _named_choice(tool_choice)
        if name not in functions:
            raise BadRequest(f"tool_choice names function {name!r}, which is not among the tools",
                             param="tool_choice.function.name")
        picked = [functions[name]]
    defs: dict[str, dict] = {}
    options = [_call_object(function, defs) for function in picked]
    schema = options[0] if tool_choice != "required" else {"anyOf": options}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


def _call_object(function: dict, defs: dict[str, dict]) -> dict:
    parameters = copy.deepcopy(function.get("parameters") or {"type": "object"})
    parameters.setdefault("type", "object")
    if _has_local_ref(parameters):
        # Inline, "#/$defs/X" would point at the wrapper's root; rebased under the root's $defs it resolves
        # (xgrammar follows object keys in a pointer but not array indices, so the anyOf path is no option).
        defs[function["name"]] = _rebase_refs(parameters, f"#/$defs/{function['name']}")
        parameters = {"$ref": f"#/$defs/{function['name']}"}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _has_local_ref(node: Any) -> bool:
    if isinstance(node, dict):
        ref = node.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(_has_local_ref(v) for v in node.values())
    return isinstance(node, list) and any(_has_local_ref(v) for v in node)


def _rebase_refs(node: Any, prefix: str) -> Any:
    """A copy of ``node`` with each local ``$ref`` ("#", "#/...") moved under ``prefix``."""
    if isinstance(node, list):
        return [_rebase_refs(v, prefix) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rebase_refs(v, prefix) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = prefix + ref[1:]
    return out


# --------------------------------------------------------------------------------------------- rendering


@dataclass(frozen=True)
class TemplateSupport:
    """What a chat template renders itself, measured by rendering probes (see ``template_support``)."""

    tools: bool  # the ``tools`` argument changes the prompt
    tool_calls: bool  # an assistant message's ``tool_calls`` appear in the prompt
    tool_results: bool  # a ``role: "tool"`` message is handled as a tool result


_PROBE_NAME = "overstory_probe_function"
_PROBE_RESULT = "overstory probe result 7f3a"
_PROBE_CALL = {"id": "call_overstoryprobe", "type": "function",
               "function": {"name": _PROBE_NAME, "arguments": {"probe_argument": "probe value"}}}
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_PROBE_USER = {"role": "user", "content": "probe question"}
# A template that handles tool results compares the role with the string "tool"; a generic template (SmolLM2's)
# also prints the result, but as a "<|im_start|>tool" turn of a role it was never trained on.
_TOOL_ROLE_IN_TEMPLATE = re.compile(r"""["']tool["']""")
_SUPPORT: dict[str, TemplateSupport] = {}


def template_support(tokenizer) -> TemplateSupport:
    """Probe the tokenizer's chat template once (cached by template text): does it render tools, assistant
    tool_calls, tool results? A probe the template refuses counts as not rendered."""
    key = repr(tokenizer.chat_template)
    if key not in _SUPPORT:
        def render(messages: list[dict], tools: list[dict] | None = None) -> str | None:
            try:
                return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                     tokenize=False)
            except Exception:  # any refusal means "not rendered"; probing must not fail the request
                return None

        plain = render([_PROBE_USER])
        with_tools = render([_PROBE_USER], [_PROBE_TOOL])
        call = {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}
        called = render([_PROBE_USER, call])
        result = render([_PROBE_USER, call, {"role": "tool", "tool_call_id": _PROBE_CALL["id"], "name": _PROBE_NAME,
                                             "content": _PROBE_RESULT}])
        _SUPPORT[key] = TemplateSupport(
            tools=with_tools is not None and with_tools != plain,
            tool_calls=called is not None and _PROBE_NAME in called,
            tool_results=(result is not None and _PROBE_RESULT in result
                          and bool(_TOOL_ROLE_IN_TEMPLATE.search(key))),
        )
    return _SUPPORT[key]


def render_chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None,
                       tool_choice: str | dict | None) -> str:
    """The prompt text for a chat request (``add_generation_prompt=True``, not tokenized).

    Content may be a string, None (an assistant turn that only calls tools) or a list of ``{"type": "text"}``
    parts, joined with newlines. Tools are offered unless tool_choice is "none"; whatever the chat template does
    not render itself (see ``template_support``) is written in the Hermes convention: the tools and the call
    syntax in the (first, merged) system message, past calls as ``<tool_call>`` text in the assistant turn,
    results as a user turn of ``<tool_response>`` blocks. Raises BadRequest for malformed messages or tools.
    """
    validate_tools(tools, tool_choice)
    support = template_support(tokenizer)
    offered = tools if tools and tool_choice != "none" else None
    conversation = _normalise_messages(messages)
    if not support.tool_calls:
        conversation = [_calls_as_text(m) if m.get("tool_calls") else m for m in conversation]
    if not support.tool_results:
        conversation = _results_as_user_turns(conversation)
    if offered and not support.tools:
        conversation = _with_system_text(conversation, _tools_system_text(offered))
    try:
        return tokenizer.apply_chat_template(conversation, tools=offered if support.tools else None,
                                             add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja's raise_exception (roles must alternate, ...): the messages are at fault
        raise BadRequest(f"the model's chat template refused these messages: {exc}", param="messages") from exc


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}[{j}] is a {kind!r} part; this model takes only text parts", param=where)
            texts.append(part["text"])
        return "\n".join(texts)
    raise BadRequest(f"{where} must be a string or a list of text parts", param=where)


def _normalise_messages(messages: Any) -> list[dict]:
    """Checked copies: content as text, tool_calls' arguments parsed to objects (as chat templates expect,
    and as vLLM passes them), tool results named after the call they answer."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    calls: dict[str, str] = {}  # tool call id -> function name, of the calls made so far
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else None
            raise BadRequest(f"{where}.role must be system, user, assistant or tool, not {role!r}",
                             param=f"{where}.role")
        role = message["role"]
        item: dict[str, Any] = {"role": role}
        if role == "assistant" and message.get("tool_calls"):
            item["tool_calls"] = _checked_calls(message["tool_calls"], f"{where}.tool_calls")
            calls.update((c["id"], c["function"]["name"]) for c in item["tool_calls"])
        if message.get("content") is None and "tool_calls" in item:
            item["content"] = ""
        else:
            item["content"] = _text(message.get("content"), f"{where}.content")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in calls:
                raise BadRequest(f"{where}.tool_call_id {call_id!r} answers no earlier assistant tool call",
                                 param=f"{where}.tool_call_id")
            item.update(tool_call_id=call_id, name=calls[call_id])
        elif isinstance(message.get("name"), str):
            item["name"] = message["name"]
        out.append(item)
    return out


def _checked_calls(tool_calls: Any, where: str) -> list[dict]:
    if not isinstance(tool_calls, list):
        raise BadRequest(f"{where} must be a list", param=where)
    checked = []
    for j, call in enumerate(tool_calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("id"), str) or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise BadRequest(f'{at} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}',
                             param=at)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not isinstance(arguments, dict):
            raise BadRequest(f"{at}.function.arguments must be a JSON object (as a string)",
                             param=f"{at}.function.arguments")
        checked.append({"id": call["id"], "type": "function",
                        "function": {"name": function["name"], "arguments": arguments}})
    return checked


def _call_text(name: str, arguments: dict) -> str:
    """One call in the syntax the system message teaches (and parse_reply reads)."""
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{CALL_CLOSE}"


def _calls_as_text(message: dict) -> dict:
    calls = [_call_text(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    text = "\n".join(([message["content"]] if message["content"] else []) + calls)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}


def _results_as_user_turns(conversation: list[dict]) -> list[dict]:
    """Tool results as user turns of <tool_response> blocks; consecutive results (parallel calls) share one."""
    out: list[dict] = []
    after_result = False
    for message in conversation:
        if message["role"] != "tool":
            out.append(message)
        else:
            block = f"{RESPONSE_OPEN}\n{message['content']}\n{RESPONSE_CLOSE}"
            if after_result:
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block})
        after_result = message["role"] == "tool"
    return out


def _tools_system_text(tools: list[dict]) -> str:
    signatures = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You can call functions to help with the user's request. Their signatures, as JSON, are inside "
            f"<tools></tools>:\n<tools>\n{signatures}\n</tools>\n"
            f'To call a function, reply with {CALL_OPEN}{{"name": <function name>, "arguments": '
            f"<arguments as a JSON object>}}{CALL_CLOSE}, one such block per call. Each result comes back "
            f"inside {RESPONSE_OPEN}{RESPONSE_CLOSE}.")


def _with_system_text(conversation: list[dict], text: str) -> list[dict]:
    """``text`` appended to the first message when it is a system message, else a new system message first
    (templates expect at most one system message, at the start)."""
    if conversation[0]["role"] == "system":
        first = conversation[0]
        merged = f"{first['content']}\n\n{text}" if first["content"] else text
        return [{**first, "content": merged}, *conversation[1:]]
    return [{"role": "system", "content": text}, *conversation]


# ----------------------------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class ParsedReply:
    """A model reply split into OpenAI fields; the caller sets ``finish_reason`` "tool_calls" when
    ``tool_calls`` is non-empty."""

    content: str | None  # text outside tool calls (None when empty, as OpenAI returns)
    tool_calls: list[dict]  # {"id": "call_<hex>", "type": "function", "function": {"name", "arguments": <JSON>}}
    malformed: int  # tool-call blocks that could not be parsed (kept in content as plain text)


def parse_reply(text: str, tools: list[dict], forced: bool) -> ParsedReply:
    """Tool calls out of a reply; never raises.

    ``forced``: the whole text should be the constrained ``{"name", "arguments"}`` object. Otherwise each
    ``<tool_call>...</tool_call>`` block (one cut short by the end of the text, or by the next opening tag,
    counts too) must hold a JSON object naming one of ``tools`` with ``arguments`` an object or a JSON string
    of one; a block that fails stays in ``content`` verbatim and counts in ``malformed``.

    >>> tools = [{"type": "function", "function": {"name": "add"}}]
    >>> reply = parse_reply('Sure.\\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', tools, False)
    >>> reply.content, reply.tool_calls, reply.malformed
    ('Sure.', [{'id': 'call_...', 'type': 'function', 'function': {'name': 'add', 'arguments': '{"a": 1}'}}], 0)
    >>> parse_reply('{"name": "sub", "arguments": {}}', tools, True)
    ParsedReply(content='{"name": "sub", "arguments": {}}', tool_calls=[], malformed=1)
    """
    text = text if isinstance(text, str) else ""
    names = _tool_names(tools)
    if forced:
        call = _safe_call(text, names)
        return ParsedReply(None, [call], 0) if call else ParsedReply(text or None, [], 1)
    kept: list[str] = []
    calls: list[dict] = []
    malformed = 0
    position = 0
    while (start := text.find(CALL_OPEN, position)) >= 0:
        body_start = start + len(CALL_OPEN)
        close = text.find(CALL_CLOSE, body_start)
        reopen = text.find(CALL_OPEN, body_start)
        if close >= 0 and (reopen < 0 or close < reopen):
            body, end = text[body_start:close], close + len(CALL_CLOSE)
        else:  # unclosed: the block runs to the next opening tag or the end of the text
            end = reopen if reopen >= 0 else len(text)
            body = text[body_start:end]
        kept.append(text[position:start])
        call = _safe_call(body, names)
        if call:
            calls.append(call)
        else:
            malformed += 1
            kept.append(text[start:end])
        position = end
    if not calls:  # nothing taken out: the text is returned exactly as generated
        return ParsedReply(text or None, [], malformed)
    kept.append(text[position:])
    # The text between calls, one piece a line: the whitespace that separated the blocks goes with them.
    content = "\n".join(piece.strip() for piece in kept if piece.strip())
    return ParsedReply(content or None, calls, malformed)


def _tool_names(tools: Any) -> set[str]:
    names = set()
    for tool in tools if isinstance(tools, list) else []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return names


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # NaN / Infinity: Python's json accepts them, JSON does not


def _loads(text: str) -> Any:
    """JSON or None; deep nesting (RecursionError) and non-standard constants count as not JSON."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None


def _safe_call(body: str, names: set[str]) -> dict | None:
    try:
        return _call_from_json(body, names)
    except Exception:  # parse_reply must answer whatever the model wrote; a surprise is one more malformed block
        return None


_FENCE = re.compile(r"\A```(?:json)?\s*(.*?)\s*```\Z", re.DOTALL)


def _call_from_json(body: str, names: set[str]) -> dict | None:
    """An OpenAI tool call from a block's JSON, or None when it is not a call of one of ``names``."""
    body = body.strip()
    fenced = _FENCE.match(body)  # small models like to wrap JSON in a markdown fence
    value = _loads(fenced.group(1) if fenced else body)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in names:
        return None
    arguments = value.get("arguments")
    if isinstance(arguments, str):
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}
