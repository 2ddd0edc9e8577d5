"""`overstory data traces`: short reasoning traces that justify each pseudo-label, from a pool of teachers.

    overstory data traces --config configs/data/traces.yaml

For every correct pseudo-label, each teacher in the pool is asked to write the planner's reply
for that question: brief reasoning ending in the JSON plan, given the label to justify. Teachers
are served chat models with a prompt style and a temperature (on a cluster, any OpenAI-compatible
endpoint via ``server_url``; on CPU the built-in model with different styles), or ``template``, a
rule-based teacher that reasons in fixed words about what the question asks for and how spread its
evidence is, and names the label's chunk sizes only in its last sentence (so a STITCH hint, which never
includes a trace's last sentence, does not state the answer); it always yields, which keeps a CPU pool
non-empty, and its traces are marked as such. An LLM teacher answers through the server's structured
outputs by default (``structured: true``: ``response_format`` with ``TRACE_SCHEMA``, reasoning first, then the two
sizes; the grammar makes a small model's reply parse), and its reply is turned into the planner's format
(reasoning, then the plan line); ``structured: false`` asks for free text as the prompt describes. A trace is kept
only when its JSON parses to exactly the label; one longer than ``max_trace_tokens`` (planner tokenizer) is
rewritten by the ``planner`` role and kept if the rewrite still matches and fits.

Each kept trace is a ``PlannerTrace``: the planner's own prompt (what the student will see), the
teacher's completion, the label, the teacher's name and the model behind it as its server reports it
(``served_model``); SFT trains on exactly these pairs. Rejected
traces go to ``<out>.rejected.jsonl`` with the raw text and are not retried (a teacher's reply is its yield); a
request that fails (timeout, server down) goes to ``<out>.failures.jsonl``, and a rerun asks that teacher again and
skips finished ids. The job runs on the fan-out skeleton (``data_pipeline/fanout.py``): its settings and the model
behind each teacher, as the servers report it, are kept in ``<out>.settings.json`` (a rerun with others is refused),
and it fails (exit code 1) when more than ``max_failure_share`` of its requests failed. The job prints the yield per
teacher. With ``runner: ray`` the (label, teacher) pairs run on Ray Data workers: the requests of the teachers
served by the job's stack (and the rewrites) are spread over ``ray.endpoints``; a teacher with a ``server_url`` of
its own keeps it, each worker calling it through a client of its own (docs/scale.md, "Data jobs on Ray").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rich.console import Console
from rich.table import Table

from overstory.core.config import ConfigError
from overstory.core.records import LEVELS, FailureRecord, JsonlAppender, PlannerTrace, PseudoLabel
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.fanout import Fanout, ServedWork, job_server, job_settings
from overstory.data_pipeline.hierarchy import cached_tokenizer
from overstory.data_pipeline.planner_examples import correct_labels, labelled_hierarchy, planner_metadata
from overstory.data_pipeline.ray_runner import RayConfig
from overstory.models.planner import (
    TRACE_RESPONSE_FORMAT,
    parse_plan,
    plan_json,
    planner_messages,
    trace_from_structured,
)
from overstory.serving.client import Client, ClientError
from overstory.serving.config import CHAT_ROLES, ServeConfig
from overstory.serving.job_client import client_for, served_models

STYLES = {
    "concise": ("You are writing the reply of a retrieval planner. The correct choice for this question is "
                "smallest_chunk_size = {level_min} and largest_chunk_size = {level_max}. Write one or two short "
                "sentences explaining why these chunk sizes fit the question, then the JSON object on the last line."),
    "stepwise": ("You are writing the reply of a retrieval planner. The correct choice for this question is "
                 "smallest_chunk_size = {level_min} and largest_chunk_size = {level_max}. Reason in at most three "
                 "short steps: what information the question asks for, where in the document it would be, how "
                 "much context is needed. Then give the JSON object on the last line."),
}
STRUCTURED_INSTRUCTION = ("Reply with one JSON object: your reasoning in \"reasoning\" first, then "
                          "\"smallest_chunk_size\" and \"largest_chunk_size\".")
REWRITE_PROMPT = ("Shorten this reasoning to at most {n} words. Keep its meaning and end with the same JSON "
                  "object on the last line.\n\n{trace}")


@dataclass(frozen=True)
class TeacherConfig:
    kind: Literal["llm", "template"] = "llm"
    role: str = "generator"  # the chat role the teacher's requests go to
    style: Literal["concise", "stepwise"] = "concise"
    temperature: float = 0.0
    max_tokens: int = 160
    server_url: str = ""  # its own OpenAI-compatible endpoint; empty: the job's stack
    # answer through response_format json_schema (TRACE_SCHEMA), enforced by the server's grammar; false: free text
    structured: bool = True

    def __post_init__(self) -> None:
        if self.role not in CHAT_ROLES:
            raise ConfigError(f"teacher role {self.role!r} is not a chat role ({', '.join(CHAT_ROLES)})")


@dataclass(frozen=True)
class TracesConfig:
    labels: str  # pseudo-label JSONL (`overstory data pseudo-labels`)
    out: str
    hierarchy: str = ""  # the chunks the labels refer to; empty: the one stored beside the labels
    teachers: dict[str, TeacherConfig] = field(default_factory=lambda: {"template": TeacherConfig(kind="template")})
    planner_tokenizer: str = "builtin:smollm2-135m-instruct"
    metadata_tokens: int = 1000  # how much of the document the planner reads
    max_trace_tokens: int = 128
    rewrite: bool = True
    concurrency: int = 2
    # each teacher request's time limit: a reply past it is a failure, retried by a rerun (the client's own default
    # of 120 s is short for a CPU teacher with many requests in flight)
    request_timeout_s: float = 120.0
    limit: int = 0  # at most this many labels (0 = all correct ones)
    max_failure_share: float = 0.0  # the job fails (exit 1) when more of its requests than this failed
    server_url: str = ""
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    runner: Literal["threads", "ray"] = "threads"  # ray: Ray Data workers, requests spread over ray.endpoints
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        if not self.teachers:
            raise ConfigError("teachers: the pool is empty; name at least one teacher")
        if self.max_trace_tokens < 8 or self.metadata_tokens < 1 or self.concurrency < 1:
            raise ConfigError("max_trace_tokens (>= 8), metadata_tokens and concurrency must be positive")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be positive, got {self.request_timeout_s}")


class TraceRejected(Exception):
    """A teacher's reply that yields no trace (an outcome, kept with its raw text); it travels back from a Ray worker
    as a result, so it pickles as its record."""

    def __init__(self, record: FailureRecord):
        super().__init__(record.error)
        self.record = record

    def __reduce__(self) -> tuple:
        return TraceRejected, (self.record,)


# what a question asks for, from its wh-word (first match wins); no phrase names a chunk size
_ASKS = [("how many", "a count"), ("how much", "an amount"), ("how long", "a duration or length"),
         ("when", "a date or time"), ("what year", "a date or time"), ("where", "a place"),
         ("who", "a person or group"), ("whom", "a person or group"), ("whose", "a person or group"),
         ("why", "a reason"), ("how", "a way or process"), ("which", "one item among several"),
         ("what", "a specific thing or fact")]
# how spread the evidence is, from the label's range (its width), in words that name no chunk size
_SPREAD = ["The evidence is one compact statement.", "The evidence is one fact; the text near it confirms it.",
           "The evidence spans a few connected statements.", "The evidence spreads over a long stretch of the text.",
           "The evidence may lie anywhere in the text."]


def _asks_for(question: str) -> str:
    words = question.lower().replace("?", " ").split()
    text = " ".join(words)
    for phrase, asks in _ASKS:
        if f" {phrase} " in f" {text} ":
            return asks
    return "a specific thing or fact"


def template_trace(level_min: str, level_max: str, question: str = "") -> str:
    """The rule-based teacher: reasoning about the question, then the evidence, and only in its last sentence the
    label's chunk sizes, then the JSON. The sentences before the last name no chunk size (the hint STITCH takes
    from a trace never includes the last sentence, so a hint does not give the label away).

    >>> for line in template_trace("sentence", "paragraph", "When did the Normans reach Normandy?").split(". "):
    ...     print(line)
    The question asks for a date or time, in 6 words
    The evidence is one fact; the text near it confirms it
    So the smallest chunk size is sentence and the largest is paragraph.
    {"largest_chunk_size": "paragraph", "smallest_chunk_size": "sentence"}
    """
    n_words = len(question.split())
    asks = (f"The question asks for {_asks_for(question)}, in {n_words} words." if question
            else "The question asks for one piece of information.")
    spread = _SPREAD[LEVELS.index(level_max) - LEVELS.index(level_min)]
    sizes = (f"So {level_min} chunks alone are enough." if level_min == level_max
             else f"So the smallest chunk size is {level_min} and the largest is {level_max}.")
    return f"{asks} {spread} {sizes}\n{plan_json(level_min, level_max)}"


def trace_for(label: PseudoLabel, teacher_name: str, teacher: TeacherConfig, prompt: list[dict[str, str]],
              clients: dict[str, Client], config: TracesConfig, count_tokens, served_model: str = "") -> PlannerTrace:
    """One teacher's trace for one label, rewritten when too long; TraceRejected when it does not match.
    ``served_model`` (the model behind the teacher, from ``served_teachers``) goes into the record."""
    trace_id = f"{label.id}/{teacher_name}"

    def reject(error: str, raw: str) -> TraceRejected:
        return TraceRejected(FailureRecord(trace_id, "traces", error, raw, 1))

    if teacher.kind == "template":
        text = template_trace(label.level_min, label.level_max, label.question)
    else:
        instruction = STYLES[teacher.style].format(level_min=label.level_min, level_max=label.level_max)
        if teacher.structured:
            instruction = f"{instruction} {STRUCTURED_INSTRUCTION}"
        messages = [prompt[0], {"role": "user", "content": f"{prompt[1]['content']}\n\n{instruction}"}]
        options = {"response_format": TRACE_RESPONSE_FORMAT} if teacher.structured else {}
        text = clients[teacher_name].chat(teacher.role, messages, max_tokens=teacher.max_tokens,
                                          temperature=teacher.temperature, seed=0, **options).text.strip()
        if teacher.structured:
            structured = trace_from_structured(text)
            if structured is None:
                raise reject("format: the reply is not a TRACE_SCHEMA object (cut off at max_tokens?)", text)
            text = structured
    rewritten = False
    if count_tokens(text) > config.max_trace_tokens:
        if not config.rewrite:
            raise reject(f"{count_tokens(text)} tokens > max_trace_tokens {config.max_trace_tokens}", text)
        shorter = clients["_job"].chat("planner", [{"role": "user", "content": REWRITE_PROMPT.format(
            n=config.max_trace_tokens // 2, trace=text)}], max_tokens=config.max_trace_tokens, temperature=0).text
        if count_tokens(shorter.strip()) > config.max_trace_tokens:
            raise reject(f"still {count_tokens(shorter)} tokens after rewriting", text)
        text, rewritten = shorter.strip(), True
    plan = parse_plan(text)
    if not plan.valid:
        raise reject(f"format: {plan.error}", text)
    if plan.levels != (label.level_min, label.level_max) or plan.swapped:
        raise reject(f"plan {plan.levels} does not match the label {(label.level_min, label.level_max)}", text)
    return PlannerTrace(id=trace_id, question_id=label.id, doc_id=label.doc_id, teacher=teacher_name,
                        prompt=prompt, completion=text,
                        label={"level_min": label.level_min, "level_max": label.level_max},
                        n_tokens=count_tokens(text), rewritten=rewritten, served_model=served_model)


def run(config: TracesConfig) -> dict:
    """Ask every teacher of the pool for a trace of every correct label the output lacks; returns the yields."""
    labels = correct_labels(config.labels)[: config.limit or None]
    metadata = planner_metadata(labelled_hierarchy(config.labels, config.hierarchy), {lb.doc_id for lb in labels},
                                config.planner_tokenizer, config.metadata_tokens)
    tokenizer = cached_tokenizer(config.planner_tokenizer)

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    yields = {name: {"kept": 0, "rejected": 0, "errors": 0, "rewritten": 0} for name in config.teachers}
    with ExitStack() as stack:
        tracker = stack.enter_context(start_run(config.tracking, "data traces", config))
        fanout = stack.enter_context(Fanout("traces", config.out, traces_settings(config),
                                            concurrency=config.concurrency,
                                            max_failure_share=config.max_failure_share, runner=config.runner,
                                            ray=config.ray))
        rejected = stack.enter_context(JsonlAppender(rejected_path(config.out)))
        jobs = fanout.todo([(label, name) for label in labels for name in config.teachers],
                           lambda job: f"{job[0].id}/{job[1]}", rejected.done)
        clients = teacher_clients(config, jobs, stack)
        served = served_teachers(config, clients)
        fanout.record_served(served)

        teachers = [name for name in clients if name != "_job"]  # names only: live clients do not go to workers

        def tracer(job_client: Client | None, pool: Mapping[str, Client] | None = None
                   ) -> Callable[[tuple[PseudoLabel, str]], PlannerTrace | TraceRejected]:
            """The trace of one (label, teacher) through ``job_client`` (the job's, or a Ray worker's for its
            endpoint) and the teachers' own servers in ``pool``."""
            own = {**({"_job": job_client} if job_client is not None else {}),
                   **{name: (pool or {}).get(name, job_client) for name in teachers}}

            def trace(job: tuple[PseudoLabel, str]) -> PlannerTrace | TraceRejected:
                label, name = job
                try:
                    return trace_for(label, name, config.teachers[name],
                                     planner_messages(label.question, metadata[label.doc_id]), own, config,
                                     count_tokens, served.get(f"teacher/{name}", ""))
                except TraceRejected as rejection:  # an outcome (the teacher's yield), not a failure to retry
                    return rejection
            return trace

        def write(job: tuple[PseudoLabel, str], result: PlannerTrace | TraceRejected) -> None:
            row = yields[job[1]]
            if isinstance(result, TraceRejected):
                rejected.write(result.record)
                fanout.count("rejected")
                row["rejected"] += 1
            else:
                fanout.write(result, "kept")
                row["kept"] += 1
                row["rewritten"] += int(result.rewritten)

        fanout.run(jobs, lambda job: f"{job[0].id}/{job[1]}", traces_work(config, clients, tracer), write, "tracing")
        for failed in fanout.failed_ids:
            yields[failed.rsplit("/", 1)[1]]["errors"] += 1
        for row in yields.values():
            judged = row["kept"] + row["rejected"]
            row["yield"] = round(row["kept"] / judged, 3) if judged else None
        fanout.finish()
        tracker.summary({f"{name}/{k}": v for name, row in yields.items() for k, v in row.items() if v is not None})
    _print_yields(yields)
    fanout.raise_if_failed()
    return yields


def rejected_path(out: str | Path) -> Path:
    """Where the rejected traces of ``out`` are kept (with the teacher's raw text; final, not retried)."""
    out = Path(out)
    return out.with_name(out.stem + ".rejected.jsonl")


def traces_settings(config: TracesConfig) -> dict:
    """What decides the traces: the job's settings, each teacher's without its endpoint (the model behind the
    endpoint is recorded from the server instead)."""
    settings = job_settings(config)
    settings["teachers"] = {name: {k: v for k, v in teacher.items() if k != "server_url"}
                            for name, teacher in settings["teachers"].items()}
    return settings


def traces_work(config: TracesConfig, clients: dict[str, Client], tracer: Callable[..., Callable]
                ) -> ServedWork | Callable:
    """The fan-out's work: ``tracer`` as ``ServedWork`` around the job's client (``_job``), the teachers with
    servers of their own as its pool, and what each endpoint must serve (the job's teachers' roles and, for the
    rewrites, the planner); a pool without the job's client: template teachers alone, which call no server."""
    if "_job" not in clients:
        return tracer(None, clients) if clients else tracer(None)
    job = clients["_job"]
    pool = {name: client for name, client in clients.items() if name != "_job" and client is not job}
    roles = {f"teacher/{name}": config.teachers[name].role for name, client in clients.items()
             if name != "_job" and client is job}
    return ServedWork(tracer, job, {"timeout_s": config.request_timeout_s}, pool=pool,
                      served_roles=roles | ({"planner": "planner"} if config.rewrite else {}))


def teacher_clients(config: TracesConfig, jobs: list[tuple[PseudoLabel, str]], stack: ExitStack) -> dict[str, Client]:
    """A client per LLM teacher (its own endpoint, or the job's stack), and the job's own (``_job``: the planner
    role rewrites long traces); the job's stack starts only when some pending job needs it (with ``runner: ray``,
    the job's client is always made, for the endpoints to be spread over: ``fanout.job_server``)."""
    llm = {name for _, name in jobs if config.teachers[name].kind == "llm"}
    clients: dict[str, Client] = {}
    spread = any(not config.teachers[name].server_url for name in llm) or config.rewrite or config.runner == "ray"
    if llm and spread:
        url, options = job_server(config.server_url, config.runner, config.ray)
        clients["_job"] = stack.enter_context(client_for(config.serve, url, timeout_s=config.request_timeout_s,
                                                         **options))
    # on Ray, the key the workers send the teachers' own servers (ray.api_key_env's), so both are let in alike
    own_options = {"api_key": config.ray.api_key()} if config.runner == "ray" else {}
    own_options["timeout_s"] = config.request_timeout_s
    for name in llm:
        url = config.teachers[name].server_url
        clients[name] = stack.enter_context(client_for(config.serve, url, **own_options)) if url else clients["_job"]
    return clients


def served_teachers(config: TracesConfig, clients: dict[str, Client]) -> dict[str, str]:
    """``teacher/<name>`` -> the model behind each LLM teacher, and ``planner`` -> the rewriter's, as the servers
    report them; a teacher whose server does not answer is left out (its requests fail and are retried)."""
    served = {}
    for name, client in clients.items():
        if name == "_job" and not config.rewrite:
            continue
        role = "planner" if name == "_job" else config.teachers[name].role
        try:
            model = served_models(client, [role]).get(role)
        except ClientError as exc:
            print(f"{name}: its server does not say what it serves ({exc})")
            continue
        if model:
            served["planner" if name == "_job" else f"teacher/{name}"] = model
    return served


def _print_yields(yields: dict[str, dict]) -> None:
    table = Table(title="trace yield per teacher (this run)")
    for column in ("teacher", "kept", "rejected", "rewritten", "errors", "yield"):
        table.add_column(column, justify="right")
    for name, row in yields.items():
        table.add_row(name, *(str(row[k]) for k in ("kept", "rejected", "rewritten", "errors")),
                      "-" if row["yield"] is None else f"{row['yield']:.2f}")
    Console(width=100).print(table)
