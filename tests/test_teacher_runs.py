"""scripts/teacher_runs.sh, the runbook of the teacher jobs: every command line it builds (each job, full size and
smoke size, and the stack on both engines) goes through the CLI up to the config load, so a renamed key or path
fails here; its per-job record sums a job's invocations (a killed or failed one, then the one that finished); an
unknown job stops it before a stack starts. The jobs themselves run in their own tests; the script's run against a
served model is the wiring check docs/data.md describes (minutes, not part of the suite)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from overstory import cli
from overstory.cli import job_config_class
from overstory.core.config import load_config
from overstory.models.registry import MINILM
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.front_door import create_front_app, mount_front_door
from overstory.serving.launch import serve_in_background
from tests.serving.vllm_stand_in import StandIn, vllm_stand_in

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "teacher_runs.sh"


def sourced(snippet: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``snippet`` in bash after sourcing the script (which then only defines its functions)."""
    return subprocess.run(["bash", "-c", f"source {shlex.quote(str(SCRIPT))}\n{snippet}"], cwd=ROOT, text=True,
                          capture_output=True, env={**os.environ, **env})


def command_lines(**env: str) -> list[str]:
    done = sourced('for job in $JOBS; do job_command "$job"; done; serve_command | tr "\\n" " "', **env)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def loaded_configs(lines: list[str], monkeypatch: pytest.MonkeyPatch) -> list:
    """Each command line run through the CLI as the script runs it, its job replaced by loading its config (nothing
    runs): the configs, in order."""
    loaded = []
    monkeypatch.setattr(cli, "run_job", lambda g, n, config_path, overrides: loaded.append(
        load_config(job_config_class(g, n), ROOT / config_path, overrides)))
    monkeypatch.chdir(ROOT)
    for line in lines:
        assert cli.main(shlex.split(line)) == 0, line
    return loaded


@pytest.mark.parametrize("env", [{}, {"TEACHER_SMOKE": "1", "TEACHER_MODEL": "builtin:smollm2-135m-instruct"},
                                 {"TEACHER_ENGINE": "vllm"}, {"TEACHER_ENGINE": "vllm", "TEACHER_DTYPE": "float32"}],
                         ids=["full", "smoke", "vllm", "vllm-float32"])
def test_every_command_line_loads_its_config(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    lines = command_lines(TEACHER_RUNS="runs/teacher-check", **env)
    assert len(lines) == 25  # the 24 jobs and the stack
    loaded = loaded_configs(lines, monkeypatch)
    assert len(loaded) == 25 and all("teacher-check" in str(config.out) for config in loaded[:-1])
    # every job that asks an LLM calls the stack; the planner chain's steps that ask none take no server_url
    asks = [config for config in loaded[:-1] if hasattr(config, "server_url")]
    assert all(config.server_url == "http://127.0.0.1:8000" for config in asks) and len(asks) == 19
    mix = next(config for config in loaded if str(config.out).endswith("planner/mix.jsonl"))
    assert mix.grounded == ["narrativeqa"]
    assert mix.sources["narrativeqa"] == "runs/teacher-check/labels/narrativeqa.jsonl"
    planner_eval = loaded[-2]
    assert planner_eval.compare == "base,sft,grpo,stitch,gold" and planner_eval.variants["stitch"].startswith(
        "runs/teacher-check/planner/stitch")
    # the planner trained on gold levels only: the same traces and recipe, the QASPER and SQuAD traces alone
    sft, gold = (next(c for c in loaded if str(c.out).endswith(f"planner/{name}")) for name in ("sft", "sft-gold"))
    assert (gold.traces, gold.datasets, sft.datasets) == (sft.traces, ["qasper", "squad"], [])
    assert planner_eval.variants["gold"] == "runs/teacher-check/planner/sft-gold/final"
    # GRPO and STITCH keep R_QA's answers in one store: STITCH reads back what GRPO asked
    rl = [c for c in loaded[:-1] if str(c.out).endswith(("planner/grpo", "planner/stitch"))]
    assert len(rl) == 2 and {c.rewards.qa_answers for c in rl} == {"runs/teacher-check/planner/rqa"}
    stack = loaded[-1]
    model = env.get("TEACHER_MODEL", "builtin:qwen2.5-coder-1.5b-instruct")
    assert {role.model for name, role in stack.roles.items() if name != "embedder"} == {model}
    assert stack.engine == env.get("TEACHER_ENGINE", "embedded")
    # the chat roles' dtype: TEACHER_DTYPE, else bfloat16 on vLLM and float32 on the embedded engine
    dtype = env.get("TEACHER_DTYPE", "bfloat16" if stack.engine == "vllm" else "float32")
    assert {name: role.dtype for name, role in stack.roles.items() if name != "embedder"} == {
        "generator": dtype, "scorer": dtype, "planner": dtype}
    if stack.engine == "vllm":
        # every job is listed, GRPO and STITCH among them: the smaller KV cache that leaves their trainer room
        assert stack.vllm_env["VLLM_CPU_KVCACHE_SPACE"] == "2" and "VLLM_CPU_OMP_THREADS_BIND" in stack.vllm_env


@pytest.mark.parametrize(("env", "gib"), [({"TEACHER_JOBS": "labels-narrativeqa planner-eval"}, "4"),
                                          ({"TEACHER_JOBS": "planner-grpo planner-eval"}, "2"),
                                          ({"TEACHER_JOBS": "planner-stitch"}, "2"),
                                          ({"TEACHER_JOBS": "planner-stitch", "TEACHER_KV_GIB": "6"}, "6")])
def test_the_kv_cache_shrinks_when_a_trainer_runs_beside_the_stack(env: dict[str, str], gib: str) -> None:
    done = sourced("kv_gib", **env)
    assert done.returncode == 0 and done.stdout.strip() == gib, done.stderr


def counters(calls: int, prompt: int, completion: int, embedded: int, failed: int = 0) -> str:
    """What ``counters`` prints: the stack's running totals by served model name."""
    return json.dumps({"generator": {"calls": calls, "prompt_tokens": prompt, "completion_tokens": completion},
                       "embedder": {"calls": 0, "prompt_tokens": embedded, "completion_tokens": 0},
                       "failed_requests": {"calls": failed, "prompt_tokens": 0, "completion_tokens": 0}})


def test_counters_reads_a_live_servers_token_counters() -> None:
    """The script's own ``counters`` (the other tests stand in for it) against a served MiniLM: the embedder's
    tokens as the server counted them."""
    embedder_only = ServeConfig(port=0, roles={"embedder": RoleConfig(model=MINILM, kind="embedding")})
    with serve_in_background(embedder_only) as url:
        reply = httpx.post(f"{url}/v1/embeddings", json={"model": "embedder", "input": ["counted by the server"]})
        done = sourced(f"counters {url}", PYTHON=sys.executable)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["embedder"]["prompt_tokens"] == reply.json()["usage"]["prompt_tokens"] > 0


def test_counters_counts_a_vllm_server_once_beside_its_front_door(tmp_path: Path) -> None:
    """A vLLM stack's counters are read from its stack.json, which lists the vLLM server and the front door, whose
    page shows that server's samples again: each is counted once (the first reading counted vLLM's twice)."""
    state = StandIn("a")
    state.prompt_tokens = 12
    with serve_in_background(vllm_stand_in(state, ["generator", "planner"])) as upstream:
        app = create_front_app()
        mount_front_door(app, {"generator": upstream, "planner": upstream}, timeout_s=30)
        with serve_in_background(app) as front:
            stack = tmp_path / "stack.json"
            stack.write_text(json.dumps({"generator": upstream, "planner": upstream, "embedder": front}))
            done = sourced(f"counters {stack}", PYTHON=sys.executable)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["generator"]["prompt_tokens"] == 12


def test_a_jobs_record_sums_its_invocations(tmp_path: Path) -> None:
    """A first invocation that failed (exit 1) writes no job record; the one that finishes writes the sums of both,
    the embedder's tokens and the refused requests apart, and the teacher's tokens/s over the summed wall time."""
    env = {"TEACHER_RUNS": str(tmp_path), "TEACHER_THREADS": "2"}
    (tmp_path / "jobs").mkdir()
    first = sourced(f"record traces-hotpotqa 1 100.0 '{counters(0, 0, 0, 0)}' '{counters(10, 5000, 800, 40)}'", **env)
    assert first.returncode == 0, first.stderr
    assert not (tmp_path / "jobs" / "traces-hotpotqa.json").exists()
    second = sourced(f"record traces-hotpotqa 0 60.0 '{counters(10, 5000, 800, 40)}' "
                     f"'{counters(30, 15000, 2400, 100, failed=3)}'", **env)
    assert second.returncode == 0, second.stderr
    summary = json.loads((tmp_path / "jobs" / "traces-hotpotqa.json").read_text())
    assert summary["invocations"] == 2 and summary["failed_invocations"] == 1 and summary["wall_s"] == 160.0
    assert (summary["llm_calls"], summary["tokens_in"], summary["tokens_out"]) == (30, 15000, 2400)
    assert summary["teacher_tokens_per_s"] == 15.0 and summary["embedder"]["prompt_tokens"] == 100
    assert summary["failed_llm_calls"] == 3
    assert "warning: traces-hotpotqa: the stack answered 3 of its completion requests with an error status" in \
        second.stderr
    assert summary["engines"] == ["embedded"] and summary["threads"] == [2] and summary["dtypes"] == ["float32"]


def test_a_cross_encoder_scorers_calls_are_not_counted_as_the_teachers(tmp_path: Path) -> None:
    """With LATTICE_SCORER the scorer's counters are a cross-encoder's (one call per candidate, nothing generated):
    the record shows them apart, and the LLM calls, tokens and tokens/s are the teacher's alone."""
    env = {"TEACHER_RUNS": str(tmp_path), "LATTICE_SCORER": "runs/teacher/distill/ce_listwise/final"}
    (tmp_path / "jobs").mkdir()
    after = json.dumps({"generator": {"calls": 65, "prompt_tokens": 20000, "completion_tokens": 230},
                        "scorer": {"calls": 1700, "prompt_tokens": 210000, "completion_tokens": 0}})
    done = sourced(f"record eval-qasper_dev.lattice.ce_listwise 0 100.0 '{{}}' '{after}'", **env)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "jobs" / "eval-qasper_dev.lattice.ce_listwise.json").read_text())
    assert (summary["llm_calls"], summary["tokens_in"], summary["teacher_tokens_per_s"]) == (65, 20000, 2.3)
    assert summary["cross_encoder"] == {"model": env["LATTICE_SCORER"], "calls": 1700, "prompt_tokens": 210000,
                                        "completion_tokens": 0}


def test_planner_eval_of_another_planner_set_keeps_its_own_record(tmp_path: Path) -> None:
    """planner-eval run with base alone (the fixed ranges before any planner is trained) records under its own
    name, so its finished record does not make a later run of the full comparison skip the job."""
    names = sourced('for v in "" base,sft,grpo,stitch,gold base sft,stitch; do PLANNER_VARIANTS=$v record_name '
                    'planner-eval; done; PLANNER_VARIANTS=base record_name planner-sft')
    assert names.returncode == 0, names.stderr
    assert names.stdout.split() == ["planner-eval", "planner-eval", "planner-eval.base", "planner-eval.sft+stitch",
                                    "planner-sft"]
    env = {"TEACHER_RUNS": str(tmp_path), "PLANNER_VARIANTS": "base"}
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "planner-eval.base.json").write_text("{}")
    skipped = sourced("run_job planner-eval", **env)
    assert skipped.returncode == 0 and "finished before" in skipped.stdout, skipped.stderr
    # the full comparison is not finished: run_job goes on to start it (here a stand-in that fails at once)
    full = sourced("OVERSTORY=false METRICS=none; counters() { echo '{}'; }; mkdir -p $TEACHER_RUNS/logs; "
                   "run_job planner-eval",
                   **{**env, "PLANNER_VARIANTS": ""})
    assert full.returncode != 0 and "planner-eval failed" in full.stderr
    assert (tmp_path / "jobs" / "planner-eval.invocations.jsonl").exists()


def test_an_eval_job_over_another_strategy_set_keeps_its_own_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """EVAL_STRATEGIES narrows an eval job to some strategies (those whose indexes exist so far): the command asks
    eval pipeline for them in the same out, and the record is the set's own, so the whole set still runs later."""
    names = sourced('for s in "" naive,smartchunk,lattice,arag,fable,orion naive,fable; do EVAL_STRATEGIES=$s '
                    'record_name eval-qasper_dev; done; EVAL_STRATEGIES=naive record_name fable-qasper_dev')
    assert names.returncode == 0, names.stderr
    assert names.stdout.split() == ["eval-qasper_dev", "eval-qasper_dev", "eval-qasper_dev.naive+fable",
                                    "fable-qasper_dev"]
    lines = {}
    for strategies in ("", "naive,fable"):
        done = sourced("job_command eval-qasper_dev", TEACHER_RUNS="runs/teacher-check", EVAL_STRATEGIES=strategies)
        assert done.returncode == 0, done.stderr
        lines[strategies] = done.stdout.strip()
    full, narrowed = loaded_configs(list(lines.values()), monkeypatch)
    assert full.strategies == "naive,smartchunk,lattice,arag,fable,orion" and narrowed.strategies == "naive,fable"
    assert full.out == narrowed.out


def test_a_distilled_cross_encoder_scores_lattice_in_an_eval_job_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """LATTICE_SCORER: the stack serves the cross-encoder as its scorer (embedded, beside the teacher on vLLM), the
    eval job searches LATTICE's tree with it into an out and a job record of its own, the teacher judging; a job
    that asks the scorer role for the teacher is refused."""
    env = {"TEACHER_RUNS": "runs/teacher-check", "TEACHER_ENGINE": "vllm", "TEACHER_JOBS": "eval-qasper_dev",
           "LATTICE_SCORER": "runs/teacher-check/distill/ce_listwise/final"}
    lines = command_lines(**env)
    evaluation, stack = loaded_configs(lines, monkeypatch)
    assert (evaluation.strategies, evaluation.lattice.scorer, evaluation.judge.role) == (
        "lattice", "cross_encoder", "generator")
    assert evaluation.out == "runs/teacher-check/eval/pipeline-qasper_dev-lattice_ce_listwise"
    scorer = stack.roles["scorer"]
    assert (scorer.model, scorer.kind, scorer.port) == (env["LATTICE_SCORER"], "cross-encoder", 0)
    assert stack.roles["generator"].model == "builtin:qwen2.5-coder-1.5b-instruct" and stack.engine == "vllm"
    named = sourced("record_name eval-qasper_dev", **env)
    assert named.stdout.strip() == "eval-qasper_dev.lattice.ce_listwise", named.stderr
    refused = sourced("job_command traces-hotpotqa", **env)
    assert refused.returncode == 2 and "LATTICE_SCORER is for eval jobs only" in refused.stderr


def test_eval_concurrency_reaches_the_eval_jobs_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """EVAL_CONCURRENCY sets how many questions an eval job answers at once; other jobs' commands ignore it."""
    lines = {}
    for job in ("eval-qasper_dev", "eval-hotpotqa", "traces-hotpotqa"):
        done = sourced(f"job_command {job}", TEACHER_RUNS="runs/teacher-check", EVAL_CONCURRENCY="8")
        assert done.returncode == 0, done.stderr
        lines[job] = done.stdout.strip()
    assert "concurrency=" not in lines["traces-hotpotqa"]
    loaded = loaded_configs([lines["eval-qasper_dev"], lines["eval-hotpotqa"]], monkeypatch)
    assert [config.concurrency for config in loaded] == [8, 8]


def test_an_unknown_job_stops_the_script_before_it_starts_a_stack(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, text=True, capture_output=True,
                          env={**os.environ, "TEACHER_RUNS": str(tmp_path / "runs"),
                               "TEACHER_JOBS": "tree-hotpotqa no-such-job"})
    assert done.returncode == 2 and "unknown job no-such-job" in done.stderr
    assert not (tmp_path / "runs").exists()


def test_jobs_that_ask_no_model_run_without_a_stack_and_are_recorded_so(tmp_path: Path) -> None:
    """SFT asks no model: the script starts no stack (nothing answers on the port it would use) and records the job
    with engine and model "none" and no calls. The job is a stand-in (a shell script that records its arguments):
    this checks the runbook's own choice, planner_sft has its own tests."""
    job = tmp_path / "overstory"
    job.write_text(f'#!/usr/bin/env bash\necho "$@" >> {tmp_path}/args\n')
    job.chmod(0o755)
    done = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, text=True, capture_output=True, timeout=120,
                          env={**os.environ, "TEACHER_RUNS": str(tmp_path / "runs"), "OVERSTORY": str(job),
                               "TEACHER_JOBS": "planner-sft planner-sft-gold", "TEACHER_ENGINE": "vllm",
                               "TEACHER_PORT": "9"})
    assert done.returncode == 0, done.stderr
    assert "no stack started" in done.stdout and "starting the" not in done.stdout
    args = (tmp_path / "args").read_text().splitlines()
    assert [line.split()[:2] for line in args] == [["train", "planner_sft"]] * 2 and "server_url" not in "".join(args)
    for name in ("planner-sft", "planner-sft-gold"):
        record = json.loads((tmp_path / "runs" / "jobs" / f"{name}.json").read_text())
        assert record["engines"] == record["models"] == ["none"] and record["llm_calls"] == 0
        assert record["invocations_without_counters"] == 0


def test_a_stopped_script_stops_its_job_and_records_the_invocation(tmp_path: Path) -> None:
    """TERM to the script (a deadline, Ctrl-C) while a job runs: the job's process is stopped, the invocation is
    recorded (its wall time, exit 143, no finished-job record) and the script exits 143, so a rerun resumes it. The
    job is a stand-in (a shell script that sleeps): this checks the runbook's own signal handling."""
    job = tmp_path / "overstory"
    job.write_text(f"#!/usr/bin/env bash\necho $$ > {tmp_path}/job.pid\nexec sleep 60\n")
    job.chmod(0o755)
    env = {**os.environ, "TEACHER_RUNS": str(tmp_path), "OVERSTORY": str(job)}
    snippet = (f"source {shlex.quote(str(SCRIPT))}\ncounters() {{ echo '{counters(0, 0, 0, 0)}'; }}\n"
               f"mkdir -p {tmp_path}/logs {tmp_path}/jobs\nURL=http://127.0.0.1:9 METRICS=$URL\n"
               "run_job traces-hotpotqa")
    script = subprocess.Popen(["bash", "-c", snippet], cwd=ROOT, env=env, text=True, stderr=subprocess.PIPE)
    pid_file = tmp_path / "job.pid"
    wait_for_file(pid_file)
    script.terminate()
    _, stderr = script.communicate(timeout=30)
    assert script.returncode == 143 and "traces-hotpotqa stopped (signal)" in stderr
    job_pid = int(pid_file.read_text())
    assert subprocess.run(["kill", "-0", str(job_pid)], capture_output=True).returncode != 0  # the job is gone
    (invocation,) = [json.loads(line) for line in (tmp_path / "jobs" / "traces-hotpotqa.invocations.jsonl")
                     .read_text().splitlines()]
    assert invocation["exit"] == 143 and invocation["wall_s"] >= 0
    assert not (tmp_path / "jobs" / "traces-hotpotqa.json").exists()


HEALTH_SERVER = """import http.server, sys, threading
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
if len(sys.argv) > 2:  # a lifetime: the server stops answering and exits, as a stack killed for memory does
    threading.Timer(float(sys.argv[2]), server.shutdown).start()
server.serve_forever()
"""


def stand_in_runbook(tmp_path: Path, lifetime_s: float | None = None) -> subprocess.Popen:
    """The runbook's ``main`` for one job that asks the teacher, with stand-ins for ``overstory`` (a stack that is a
    Python HTTP server answering /health, for ``lifetime_s`` if given; a job that sleeps) and for the counters (they
    say whether the stack still answered when they were read); in its own process group, as under `timeout`."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "health.py").write_text(HEALTH_SERVER)
    stand_in = tmp_path / "overstory"
    lifetime = "" if lifetime_s is None else f" {lifetime_s}"
    stand_in.write_text(f"#!/usr/bin/env bash\nif [[ $1 == serve ]]; then echo $$ > {tmp_path}/stack.pid\n"
                        f"  exec {shlex.quote(sys.executable)} {tmp_path}/health.py {port}{lifetime}; fi\n"
                        f"echo $$ > {tmp_path}/job.pid\nexec sleep 60\n")
    stand_in.chmod(0o755)
    snippet = (f"source {shlex.quote(str(SCRIPT))}\n"
               f"counters() {{ if curl -sf \"$URL/health\" > /dev/null; then echo '{counters(0, 0, 0, 0)}'; "
               "else echo '{\"unavailable\": \"the stack did not answer\"}'; fi; }\nmain")
    env = {**os.environ, "TEACHER_RUNS": str(tmp_path / "runs"), "OVERSTORY": str(stand_in),
           "TEACHER_JOBS": "traces-hotpotqa", "TEACHER_PORT": str(port), "WATCH_S": "0.2"}
    return subprocess.Popen(["bash", "-c", snippet], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


def wait_for_file(path: Path) -> None:
    """Wait (up to 30 s) until the stand-in job has written its pid to ``path``."""
    for _ in range(300):
        if path.exists() and path.read_text().strip():
            return
        time.sleep(0.1)
    raise AssertionError(f"{path} never appeared")


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (waiting up to 5 s)."""
    for _ in range(50):
        if subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0:
            return True
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    return False


def only_invocation(tmp_path: Path) -> dict:
    (row,) = [json.loads(line) for line in (tmp_path / "runs" / "jobs" / "traces-hotpotqa.invocations.jsonl")
              .read_text().splitlines()]
    return row


def test_a_signal_to_the_scripts_process_group_leaves_the_stack_up_for_the_counters(tmp_path: Path) -> None:
    """`timeout` sends its TERM to the script's whole process group: the job stops, but the stack (in its own
    session) still answers when the stopped invocation's counters are read, and the script stops it on exit."""
    script = stand_in_runbook(tmp_path)
    wait_for_file(tmp_path / "job.pid")
    os.killpg(script.pid, signal.SIGTERM)  # what `timeout` does
    _, stderr = script.communicate(timeout=30)
    # (the group's TERM often kills the job before the script's trap runs, so the trap's kill of it fails: under
    # set -e that must not end the script with 1)
    assert script.returncode == 143 and "traces-hotpotqa stopped (signal)" in stderr, stderr
    invocation = only_invocation(tmp_path)
    assert invocation["exit"] == 143 and "counters_unavailable" not in invocation
    assert gone(int((tmp_path / "stack.pid").read_text())), "the stack outlived the script"


def test_a_stack_that_exits_under_a_job_stops_the_job_and_the_script(tmp_path: Path) -> None:
    """The stack exits while a job runs (its vLLM server killed for memory takes it down): the job is stopped at
    once rather than left to fail every later request, its invocation is recorded (without counters: nothing
    answers), and the script exits 1 saying so, with no finished-job record, so a rerun resumes the job."""
    script = stand_in_runbook(tmp_path, lifetime_s=8)  # past the stack start-up poll (5 s)
    wait_for_file(tmp_path / "job.pid")
    _, stderr = script.communicate(timeout=60)
    assert script.returncode == 1 and "the teacher stack exited while traces-hotpotqa ran" in stderr, stderr
    assert gone(int((tmp_path / "job.pid").read_text())), "the job outlived the stack"
    invocation = only_invocation(tmp_path)
    assert invocation["exit"] == 143 and invocation["counters_unavailable"] == "the stack did not answer"
    assert not (tmp_path / "runs" / "jobs" / "traces-hotpotqa.json").exists()


def test_an_invocation_whose_stack_was_gone_is_recorded_without_counts(tmp_path: Path) -> None:
    """The stack stopped with the job (a signal to the whole process group): the invocation is recorded with its
    counters marked missing, and the finished job's tokens/s divides only the counted invocations' tokens by their
    own wall time, so the uncounted stretch does not lower the teacher's measured rate."""
    env = {"TEACHER_RUNS": str(tmp_path), "TEACHER_THREADS": "2"}
    (tmp_path / "jobs").mkdir()
    gone = json.dumps({"unavailable": "transport error: ConnectError calling http://127.0.0.1:8001/metrics"})
    first = sourced(f"record tree-hotpotqa 143 500.0 '{counters(0, 0, 0, 0)}' '{gone}'", **env)
    assert first.returncode == 0, first.stderr
    second = sourced(f"record tree-hotpotqa 0 100.0 '{counters(0, 0, 0, 0)}' '{counters(5, 900, 700, 0)}'", **env)
    assert second.returncode == 0, second.stderr
    rows = [json.loads(line) for line in (tmp_path / "jobs" / "tree-hotpotqa.invocations.jsonl").read_text()
            .splitlines()]
    assert "ConnectError" in rows[0]["counters_unavailable"] and rows[0]["by_served_model"] == {}
    summary = json.loads((tmp_path / "jobs" / "tree-hotpotqa.json").read_text())
    assert summary["invocations_without_counters"] == 1 and summary["wall_s"] == 600.0
    assert summary["tokens_out"] == 700 and summary["teacher_tokens_per_s"] == 7.0


def test_counters_of_a_stack_that_does_not_answer_say_so(tmp_path: Path) -> None:
    done = sourced("counters http://127.0.0.1:9", TEACHER_RUNS=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "ConnectError" in json.loads(done.stdout)["unavailable"]
