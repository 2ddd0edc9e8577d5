#!/usr/bin/env bash
# LATTICE's students distilled from the CPU teacher's traces, then eval lattice on their held-out questions:
#   nohup bash scripts/lattice_students.sh > /dev/null 2>&1 &     (progress: runs/teacher/logs/lattice_students.log)
#   bash scripts/lattice_students.sh --dry-run                   (prints the commands, runs nothing)
# from the repository root, after both traces jobs of scripts/teacher_runs.sh finished (traces-hotpotqa and
# traces-qasper_train: runs/teacher/jobs/<job>.json), since the students read both trace files.
# 1. the students (configs/train/distill_scorer_{llm,cross_encoder}-teacher.yaml; every one on both trace files with
#    the same val_fraction, so they hold out the same questions): the LoRA student on SmolLM2, and the cross-encoder
#    pointwise, and ListNet and LambdaLoss each trained through an identity and a sigmoid head (the pointwise loss
#    trains the logit under either head, so its activation only changes what is served), and the gold-label row;
# 2. eval lattice on HotpotQA and on the QASPER train papers (configs/eval/lattice-{hotpotqa,qasper_train}-teacher.yaml):
#    the teacher's row is read from its traces job (kind recorded), not re-run.
# Resume: rerun the script. A student with <out>/final/overstory.json is finished and skipped (rerunning a finished
# run would resume at its last step, train nothing and rewrite its metrics.json with that empty run's loss and
# seconds; delete <out> to train it again); an interrupted one resumes from its newest checkpoint, under the settings
# it was trained with (distill-scorer refuses others, naming the keys). The evals always run again (they take minutes).
# Threads: OMP_NUM_THREADS as exported (default: every core). Any failing command stops the script; the log says which.
# Some students only: LATTICE_STUDENTS="ce_pointwise ce_gold" (names as in STUDENTS below; default: all); the evals
# then compare those students with the teacher, the oracle and the baselines (--compare).
set -euo pipefail
DRY=0
[[ ${1:-} == --dry-run ]] && DRY=1
OVERSTORY=${OVERSTORY:-$( [[ -x .venv/bin/overstory ]] && echo .venv/bin/overstory || echo overstory )}
LOG=${STUDENTS_LOG:-runs/teacher/logs/lattice_students.log}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
CE=configs/train/distill_scorer_cross_encoder-teacher.yaml
LLM=configs/train/distill_scorer_llm-teacher.yaml
D=runs/teacher/distill

# name | config | overrides: one student each (the folder is $D/<name>; its eval row is <name>, the LLM's llm_student)
STUDENTS=(
  "llm|$LLM|"
  "ce_pointwise|$CE|"
  "ce_listwise|$CE|loss=listwise activation=identity"
  "ce_listwise_sigmoid|$CE|loss=listwise activation=sigmoid"
  "ce_lambdaloss|$CE|loss=lambdaloss activation=identity"
  "ce_lambdaloss_sigmoid|$CE|loss=lambdaloss activation=sigmoid"
  "ce_gold|$CE|targets=gold"
)

say() {  # a progress line, to the terminal and the log
  echo "== $(date -u +%FT%TZ) $*" | { [[ $DRY == 1 ]] && cat || tee -a "$LOG"; }
}

run() {  # run (or with --dry-run print) one overstory command, its output to the log
  if [[ $DRY == 1 ]]; then echo "overstory $*"; return; fi
  local started=$SECONDS
  say "overstory $*"
  "$OVERSTORY" "$@" >> "$LOG" 2>&1 || { say "FAILED (exit $?): overstory $*"; exit 1; }
  say "done in $((SECONDS - started)) s"
}

if [[ $DRY == 0 ]]; then
  mkdir -p "$(dirname "$LOG")"
  for job in traces-hotpotqa traces-qasper_train; do
    [[ -f runs/teacher/jobs/$job.json ]] || { echo "$job has not finished (no runs/teacher/jobs/$job.json): the" \
      "students read its traces; run scripts/teacher_runs.sh first" >&2; exit 1; }
  done
  say "lattice students ($OMP_NUM_THREADS threads)"
fi
ONLY=${LATTICE_STUDENTS:-}
ROWS=oracle,teacher
TRAINED=()
for student in "${STUDENTS[@]}"; do
  IFS='|' read -r name config overrides <<< "$student"
  [[ -z $ONLY || " $ONLY " == *" $name "* ]] || continue
  TRAINED+=("$name")
  ROWS+=,$([[ $name == llm ]] && echo llm_student || echo "$name")
  if [[ $DRY == 0 && -f $D/$name/final/overstory.json ]]; then
    say "$name: finished before ($D/$name/final; delete $D/$name to train it again)"
    continue
  fi
  # shellcheck disable=SC2086  # the overrides are words
  run train distill-scorer --config "$config" out="$D/$name" $overrides
done
COMPARE=()
# some students only: compare those, and take the held-out questions from one of them (the evals' configs read them
# from ce_pointwise's folder, which such a run may not have trained; every student holds out the same questions)
[[ -z $ONLY ]] || COMPARE=(--compare "$ROWS,bm25,dense,hybrid,lattice++" heldout_from="$D/${TRAINED[0]}")
for ds in hotpotqa qasper_train; do
  run eval lattice --config "configs/eval/lattice-$ds-teacher.yaml" "${COMPARE[@]}"
done
[[ $DRY == 1 ]] || say "tables: runs/teacher/eval/lattice-{hotpotqa,qasper_train}/table.md"
