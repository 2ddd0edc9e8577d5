"""Request batching for the embedded engine: concurrent requests to one chat model share ``generate`` calls.

Each chat model gets a ``Batcher``: a worker thread that takes the queued requests (``Job``s), waits until
requests stop arriving (a short quiet gap, capped), groups the oldest request with the queued ones that share its
sampling settings (greedy with greedy; sampled with the same temperature, top-p, top-k and min-p; a seeded
request alone, so its seed reproduces), and runs them as one left-padded ``model.generate``, the prompts'
common prefix prefilled once for all rows. Requests that arrive during a generation join the next batch.
Measured before choosing (SmolLM2-135M on 2 CPU cores, 8 greedy 16-token requests): one
left-padded ``generate`` took 3.4 s against 7.8 s one by one, while transformers' continuous batching
(``generate_batch``, paged eager attention) took 13.2 s on CPU; static batches around ``generate`` win here.

Rows of one batch differ in what ``generate`` applies batch-wide, so ``RowControl`` (a stopping criterion
called after every decoding step) gives each row its own ``max_tokens``, stop strings and cancellation, and
hands streamed text deltas to the request; ``RowPenalties`` gives each row its own presence, frequency and
repetition penalties and logit bias; per-row grammars come from ``serving.structured``. A client that
disconnects cancels its job: its rows stop at the next step, and a batch whose rows are all done ends early.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

log = logging.getLogger(__name__)

# Sampling draws from torch's global generator, so a seeded request is reproducible only if no other sampled
# generation (on another model) runs at the same time; greedy batches never take this lock.
_SAMPLING_LOCK = threading.Lock()


@dataclass(frozen=True)
class Sampling:
    """What one request asks of generation. ``logprobs``: None for none, k >= 0 for each generated token's
    log-probability and its k best alternatives. ``top_k`` 0 and ``min_p`` 0 leave them off. The penalties
    and ``logit_bias`` (token id, bias) pairs apply before temperature, as in OpenAI's and vLLM's samplers."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether ``RowPenalties`` has anything to do for this request."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    def batch_key(self, job_id: int) -> tuple:
        """Requests with equal keys can share one ``generate`` call (max_tokens, stop strings, logprobs,
        penalties, logit bias and grammars are per row; the decoding strategy is batch-wide: greedy ignores
        top-k and min-p, whose argmax they always keep). A seeded request gets a key of its own."""
        if self.greedy:
            return ("greedy",)
        return ("sample", self.temperature, self.top_p, self.top_k, self.min_p,
                job_id if self.seed is not None else None)


class RowPenalties(LogitsProcessor):
    """Each row's own penalties and logit bias, applied to the raw logits before temperature and truncation.

    OpenAI's definitions for the generated tokens of a row: ``logit[j] -= count[j] * frequency_penalty +
    (count[j] > 0) * presence_penalty``, then ``logit[j] += logit_bias[j]``; vLLM's (and CTRL's)
    ``repetition_penalty`` over the prompt and generated tokens: a positive logit is divided by it, a negative
    one multiplied. The prompt's tokens come from the row's own ids, not the padded batch."""

    def __init__(self, rows: list[tuple[Sampling, list[int]]]):
        self.rows = rows
        self.start: int | None = None  # the batch's input width: generated tokens follow it

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.start is None:
            self.start = input_ids.shape[1]
        for i, (sampling, prompt) in enumerate(self.rows):
            if sampling.penalised:
                scores[i] = self._row(sampling, prompt, input_ids[i, self.start:], scores[i])
        return scores

    @staticmethod
    def _row(sampling: Sampling, prompt: list[int], generated: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        if sampling.repetition_penalty != 1.0:
            seen = torch.cat([torch.tensor(prompt, device=logits.device), generated]).unique()
            picked = logits[seen]
            logits[seen] = torch.where(picked > 0, picked / sampling.repetition_penalty,
                                       picked * sampling.repetition_penalty)
        if sampling.presence_penalty or sampling.frequency_penalty:
            counts = torch.bincount(generated, minlength=logits.shape[0])[: logits.shape[0]].to(logits.dtype)
            logits -= counts * sampling.frequency_penalty + (counts > 0).to(logits.dtype) * sampling.presence_penalty
        if sampling.logit_bias:
            ids, biases = zip(*sampling.logit_bias)
            logits[list(ids)] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
        return logits


@dataclass
class RowOutput:
    """One generated sequence: its token ids (an end-of-sequence token included), why it ended, where a stop
    string cut its text, and its per-step raw logits when logprobs were asked for."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "cancelled"
    text: str = ""
    logits: torch.Tensor | None = None


class Job:
    """One request: ``prompts`` (token ids) each generated ``sampling.n`` times (once when greedy: the copies
    would be identical). ``on_delta(choice_index, text)`` receives streamed text from the worker thread."""

    _ids = itertools.count()

    def __init__(self, prompts: list[list[int]], sampling: Sampling, grammar: object | None = None,
                 on_delta: Callable[[int, str], None] | None = None):
        self.id = next(Job._ids)
        self.prompts, self.sampling, self.grammar, self.on_delta = prompts, sampling, grammar, on_delta
        self.copies = 1 if sampling.greedy else sampling.n
        self.longest_prompt = max(len(p) for p in prompts)
        self.rows = [RowOutput() for _ in range(len(prompts) * self.copies)]
        self.cancelled = threading.Event()
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None  # when its batch produced its first token (time to first token)
        self._done = threading.Event()
        self._callbacks: list[Callable[[], None]] = []
        self._callbacks_lock = threading.Lock()
        self.error: BaseException | None = None

    def cancel(self) -> None:
        """Stop generating for this request (its client went away); its rows end at the next step."""
        self.cancelled.set()

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        with self._callbacks_lock:
            self._done.set()
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback()

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the worker thread) once the job has finished, or now if it already has."""
        with self._callbacks_lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def wait(self, timeout: float | None = None) -> list[RowOutput]:
        """Block until the job's batch has run; its rows, or the error that ended the batch."""
        if not self._done.wait(timeout):
            raise TimeoutError("generation did not finish in time")
        if self.error is not None:
            raise self.error
        return self.rows

    def emit(self, row: int, text: str) -> None:
        """Stream ``text`` for row ``row`` to every choice that row stands for (greedy rows serve all n)."""
        if self.on_delta is None or not text:
            return
        prompt, copy = divmod(row, self.copies)
        indices = range(prompt * self.sampling.n, (prompt + 1) * self.sampling.n) if self.sampling.greedy \
            else [prompt * self.sampling.n + copy]
        for index in indices:
            self.on_delta(index, text)


class RowControl(StoppingCriteria):
    """Called by ``generate`` after every step with the batch so far: records each live row's new token,
    decides per row whether it is done (end of sequence, its own max_tokens, one of its stop strings, its
    job cancelled) and streams the text that can no longer change."""

    def __init__(self, tokenizer, rows: list[tuple[Job, int]]):
        self.tokenizer, self.rows = tokenizer, rows
        self.eos = tokenizer.eos_token_id
        self._sent = [0] * len(rows)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        last = input_ids[:, -1].tolist()
        now = time.monotonic()
        for job, _ in self.rows:
            if job.first_token_at is None:
                job.first_token_at = now
        done = []
        for i, (job, r) in enumerate(self.rows):
            row = job.rows[r]
            if row.finish_reason is None:
                self._step(i, job, r, row, last[i])
            done.append(row.finish_reason is not None)
        # one tensor made at once: a write per row into a GPU tensor would be one small copy per row and step
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    def _step(self, i: int, job: Job, r: int, row: RowOutput, token: int) -> None:
        row.tokens.append(token)
        stop, streaming = job.sampling.stop, job.on_delta is not None
        if token == self.eos:
            row.finish_reason = "stop"
        elif job.cancelled.is_set():
            row.finish_reason = "cancelled"
            return
        if stop or streaming:
            text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
            row.text = cut_at_stop(text, stop)
            if len(row.text) < len(text):
                row.finish_reason = "stop"
        if row.finish_reason is None and len(row.tokens) >= job.sampling.max_tokens:
            row.finish_reason = "length"
        if streaming:
            visible = row.text
            if row.finish_reason is None:
                # hold back an incomplete character and what may still become a stop string
                visible = visible.rstrip("\ufffd")
                hold = max((len(s) - 1 for s in stop), default=0)
                visible = visible[: max(len(visible) - hold, self._sent[i])]
            job.emit(r, visible[self._sent[i]:])
            self._sent[i] = max(self._sent[i], len(visible))


class Batcher:
    """Runs the ``Job``s submitted for one chat model in batched ``generate`` calls on a worker thread.

    ``max_batch_size`` caps the rows of one call and ``max_batch_tokens`` its padded prompt tokens (rows x the
    longest prompt): on CPU a prefill costs what its padded tokens cost, so long prompts share a call only with
    few others (a single job larger than either cap still runs, alone). Once a request arrives, the worker waits
    until none has arrived for ``window_s``, ``max_wait_s`` has passed or the queue fills a batch: clients that
    send together reach the server spread over tens of milliseconds (the HTTP server parses them one by one: 32
    concurrent SmolLM2 requests arrived over 80-150 ms with gaps up to 19 ms), and a fixed 5 ms window caught 1-5
    of them, leaving the rest to wait for that small batch. ``running`` and ``waiting`` (rows) feed
    the server's queue-depth gauges."""

    def __init__(self, model, tokenizer, max_batch_size: int = 32, max_batch_tokens: int = 4096,
                 window_s: float = 0.025, max_wait_s: float = 0.25,
                 grammar_processor: Callable[[list, int], object] | None = None, name: str = "model"):
        self.model, self.tokenizer = model, tokenizer
        self.max_batch_size, self.max_batch_tokens = max_batch_size, max_batch_tokens
        self.window_s, self.max_wait_s = window_s, max_wait_s
        self.grammar_processor = grammar_processor
        # (rows, shared prefix tokens) of the latest generate calls, for benchmarks and tests; bounded, so that a
        # long-running server does not grow with it
        self.recent_batches: deque[tuple[int, int]] = deque(maxlen=256)
        self.running = 0
        self.on_change: Callable[[int, int], None] | None = None  # (running rows, waiting rows), for metrics
        self._queue: list[Job] = []
        self._arrivals = 0  # jobs ever submitted: the collection wait watches it grow
        self._current: list[Job] = []
        self._stopping = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=f"batcher-{name}", daemon=True)
        self._thread.start()
        _BATCHERS.add(self)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancel what is queued or running and end the worker (a daemon thread still inside ``generate`` when
        the interpreter exits would crash it)."""
        with self._cond:
            self._stopping = True
            for job in self._queue + self._current:
                job.cancel()
            self._cond.notify()
        self._thread.join(timeout_s)

    @property
    def waiting(self) -> int:
        with self._cond:
            return sum(len(job.rows) for job in self._queue)

    def submit(self, job: Job) -> Job:
        with self._cond:
            self._queue.append(job)
            self._arrivals += 1
            self._cond.notify()
        self._report()
        return job

    def _report(self) -> None:
        if self.on_change is not None:
            self.on_change(self.running, self.waiting)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    for job in self._queue:
                        job.finish(RuntimeError("the server is shutting down"))
                    return
            self._collect()
            jobs = []
            for job in self._take_batch():
                if job.cancelled.is_set():  # its client left while it waited
                    for row in job.rows:
                        row.finish_reason = "cancelled"
                    job.finish()
                else:
                    jobs.append(job)
            self._report()
            if not jobs:
                continue
            try:
                self._generate(jobs)
            except Exception as exc:  # a failed batch fails its requests, never the worker
                log.exception("batched generation failed")
                for job in jobs:
                    job.finish(exc)
            else:
                for job in jobs:
                    job.finish()
            finally:
                self.running = 0
                self._current = []
                self._report()

    def _collect(self) -> None:
        """Wait while requests keep arriving: until none came for ``window_s``, ``max_wait_s`` after the call, or
        until the queue holds a full batch."""
        deadline = time.monotonic() + self.max_wait_s
        with self._cond:
            while not self._stopping:
                seen = self._arrivals
                quiet_until = min(time.monotonic() + self.window_s, deadline)
                while self._arrivals == seen and not self._stopping and (left := quiet_until - time.monotonic()) > 0:
                    self._cond.wait(left)
                full = sum(len(job.rows) for job in self._queue) >= self.max_batch_size
                if self._arrivals == seen or full or time.monotonic() >= deadline:
                    return

    def _take_batch(self) -> list[Job]:
        """The oldest job plus, in arrival order, queued jobs with its batch key while the rows and the padded
        prompt tokens fit."""
        with self._cond:
            first = self._queue[0]
            key = first.sampling.batch_key(first.id)
            batch, rows, longest, rest = [first], len(first.rows), first.longest_prompt, []
            for job in self._queue[1:]:
                fits = (rows + len(job.rows) <= self.max_batch_size
                        and (rows + len(job.rows)) * max(longest, job.longest_prompt) <= self.max_batch_tokens)
                if job.sampling.batch_key(job.id) == key and fits:
                    batch.append(job)
                    rows += len(job.rows)
                    longest = max(longest, job.longest_prompt)
                else:
                    rest.append(job)
            self._queue = rest
            self.running = rows
            self._current = batch
            return batch

    def _generate(self, jobs: list[Job]) -> None:
        rows = [(job, r) for job in jobs for r in range(len(job.rows))]
        prompts = [job.prompts[r // job.copies] for job, r in rows]
        sampling = jobs[0].sampling
        want_logits = any(job.sampling.logprobs is not None for job in jobs)
        config = GenerationConfig(
            max_new_tokens=max(job.sampling.max_tokens for job in jobs), do_sample=not sampling.greedy,
            temperature=None if sampling.greedy else sampling.temperature,
            top_p=None if sampling.greedy else sampling.top_p,
            top_k=None if sampling.greedy or not sampling.top_k else sampling.top_k,
            min_p=None if sampling.greedy or not sampling.min_p else sampling.min_p,
            eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
            output_logits=want_logits, return_dict_in_generate=True,
        )
        processors = LogitsProcessorList()
        # custom processors run before generate's own temperature, top-k, top-p and min-p warpers
        if any(job.sampling.penalised for job in jobs):
            processors.append(RowPenalties([(job.sampling, job.prompts[r // job.copies]) for job, r in rows]))
        if self.grammar_processor and any(job.grammar is not None for job in jobs):
            processors.append(self.grammar_processor([job.grammar for job, _ in rows], self.tokenizer.eos_token_id))
        control = RowControl(self.tokenizer, rows)
        with nullcontext() if sampling.greedy else _SAMPLING_LOCK, torch.inference_mode():
            inputs = self._prefill_shared_prefix(prompts)
            shared = inputs["past_key_values"].get_seq_length() if "past_key_values" in inputs else 0
            self.recent_batches.append((len(rows), shared))
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            output = self.model.generate(**inputs, generation_config=config, logits_processor=processors,
                                         stopping_criteria=StoppingCriteriaList([control]))
        for i, (job, r) in enumerate(rows):
            row = job.rows[r]
            if row.finish_reason is None:  # generate stopped at max_new_tokens before the row's own check
                row.finish_reason = "length"
            row.text = cut_at_stop(self.tokenizer.decode(row.tokens, skip_special_tokens=True), job.sampling.stop)
            if want_logits and job.sampling.logprobs is not None:
                row.logits = torch.stack([step[i] for step in output.logits[: len(row.tokens)]])

    def _prefill_shared_prefix(self, prompts: list[list[int]]) -> dict:
        """``generate``'s inputs for the rows' prompts, with the tokens every prompt starts with computed once.

        Chat prompts share the template's opening (SmolLM2's default system message: 24 of the 36-47 tokens of a
        SQuAD question), and n > 1 samples share their whole prompt. That prefix is run once for one row and its
        key-value cache copied to every row; ``generate`` then prefills only the rows' own suffixes, laid out as
        ``[prefix][padding][suffix]``: positions come from the attention mask, so the padding in the middle
        changes nothing (greedy outputs are the same, tested). vLLM's prefix cache does this across requests;
        here it is within a batch, which is where the rows of one ``generate`` call save their prefill."""
        device = self.model.device
        shared = _common_prefix_length(prompts) if len(prompts) > 1 else 0
        if shared < SHARED_PREFIX_MIN_TOKENS:
            return self.tokenizer.pad({"input_ids": prompts}, padding=True, padding_side="left",
                                      return_tensors="pt").to(device)
        prefix = torch.tensor([prompts[0][:shared]], device=device)
        cache = self.model(prefix, use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(prompts))
        suffixes = self.tokenizer.pad({"input_ids": [p[shared:] for p in prompts]}, padding=True,
                                      padding_side="left", return_tensors="pt").to(device)
        return {"input_ids": torch.cat([prefix.expand(len(prompts), -1), suffixes["input_ids"]], dim=1),
                "attention_mask": torch.cat([torch.ones(len(prompts), shared, dtype=torch.long, device=device),
                                             suffixes["attention_mask"]], dim=1),
                "past_key_values": cache}


# a shorter common prefix saves less than its extra forward pass costs
SHARED_PREFIX_MIN_TOKENS = 8


def _common_prefix_length(prompts: list[list[int]]) -> int:
    """How many leading tokens all ``prompts`` share, leaving every prompt at least one token of its own
    (``generate`` needs a token to run for each row's first logits).

    >>> _common_prefix_length([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]])
    2
    >>> _common_prefix_length([[7, 8, 9], [7, 8, 9]])
    2
    """
    limit = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for i in range(limit):
        if any(p[i] != first[i] for p in prompts):
            return i
    return max(limit, 0)


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """``text`` up to the first stop string (left out, as OpenAI does).

    >>> cut_at_stop("a, b. c.", (".", "!"))
    'a, b'
    """
    cut = min((at for s in stop if (at := text.find(s)) >= 0), default=-1)
    return text if cut < 0 else text[:cut]


_BATCHERS: weakref.WeakSet[Batcher] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for batcher in list(_BATCHERS):
        batcher.stop()
