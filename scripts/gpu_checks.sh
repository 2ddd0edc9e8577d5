#!/usr/bin/env bash
# The bf16 paths on one GPU, in one go: batched generation on the embedded engine (float32 against bf16, 1 to 128
# concurrent requests) for the built-in model and SmolLM2-1.7B's size, and the planner recipes' training steps
# (SFT with LoRA in float32 and bf16, full SFT at 1.7B in bf16 with MFU, GRPO/DAPO steps in bf16), and the same at
# the CPU teacher's shape (Qwen2.5-Coder-1.5B): its generation per dtype and full-fine-tuning GRPO/DAPO steps, what
# the planner jobs of configs/train/planner_grpo-qwen2.5-1.5b.yaml cost a step on one GPU.
#   bash scripts/gpu_checks.sh            (from the repository root, on a GPU machine, after `make env`)
# Each stage writes its log and results under OUT and the script goes on when one fails (the summary at the end
# lists every stage's exit code and seconds). Settings through the environment:
#   MODEL, MODEL_LARGE   the models to run (the built-in SmolLM2-135M; SmolLM2-1.7B from the hub). A machine that
#                        reaches no hub can give folders made by scripts/random_init_model.py: same shapes, random
#                        weights, so the same speed (and meaningless outputs).
#   MODEL_TEACHER        the teacher's shape (Qwen2.5-Coder-1.5B-Instruct from the hub, or such a folder)
#   TRACES, LABELS       planner traces for SFT, pseudo- or gold labels (with their hierarchy beside them) for GRPO
#   PEAK_TFLOPS          the GPU's dense bf16 peak for MFU (989: H100 and H200 SXM)
#   QUICK=1              a few requests and steps: checks that every stage runs (e.g. on a CPU with DEVICE=cpu)
#   PROBE_FOLDER         a folder (or hub id) with SmolLM2's config and tokenizer, for the decode probe
#   STAGES               which stages run (default: env decode-probe generate-135m generate-1.7b train
#                        generate-teacher train-teacher)
#   PROBE_ARGS           the decode probe's arguments (e.g. "--shapes smollm2-135m --max-tokens 48")
#   SFT_STEPS, FULL_STEPS, GRPO_STEPS, TEACHER_GRPO_STEPS   steps of the LoRA SFT, full SFT, GRPO and the
#                        teacher-shape GRPO recipes (30, 10, 3, 5): more steps, a steadier logged-step figure
set -uo pipefail
OUT=${OUT:-runs/gpu_checks}
MODEL=${MODEL:-builtin:smollm2-135m-instruct}
MODEL_LARGE=${MODEL_LARGE:-HuggingFaceTB/SmolLM2-1.7B-Instruct}
MODEL_TEACHER=${MODEL_TEACHER:-Qwen/Qwen2.5-Coder-1.5B-Instruct}
TRACES=${TRACES:-runs/data/traces/squad.jsonl}
LABELS=${LABELS:-runs/data/pseudo_labels/squad.jsonl}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-0}
PROBE_FOLDER=${PROBE_FOLDER:-HuggingFaceTB/SmolLM2-135M-Instruct}
STAGES=" ${STAGES:-env decode-probe generate-135m generate-1.7b train generate-teacher train-teacher} "
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

stage() {  # stage NAME COMMAND...: run, log to OUT/NAME.log, record exit code and seconds (if NAME is in STAGES)
  local name=$1 started rc
  shift
  [[ $STAGES == *" $name "* ]] || return 0
  started=$(date +%s)
  echo "== $name: $*"
  "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - started )) s" | tee -a "$SUMMARY"
  tail -n 14 "$OUT/$name.log"
}

if [[ $QUICK == 1 ]]; then
  GEN="concurrency=[1,4] requests_per_level=4 max_tokens=8"
  GEN_LARGE="concurrency=[1,4] requests_per_level=4 max_tokens=8"
  PROBE="--shapes smollm2-135m --max-tokens 4"
  SFT_STEPS=2 FULL_STEPS=2 GRPO_STEPS=1 TEACHER_GRPO_STEPS=1 SFT_BATCH=2 FULL_BATCH=2 GRPO_BATCH=4 GRPO_GENERATIONS=4 MAX_LENGTH=512
else
  GEN="concurrency=[1,8,32,128] requests_per_level=8 max_tokens=128"
  GEN_LARGE="concurrency=[1,32,128] requests_per_level=8 max_tokens=64"
  PROBE=${PROBE_ARGS:-}
  SFT_STEPS=${SFT_STEPS:-30} FULL_STEPS=${FULL_STEPS:-10} GRPO_STEPS=${GRPO_STEPS:-3}
  TEACHER_GRPO_STEPS=${TEACHER_GRPO_STEPS:-5}
  SFT_BATCH=16 FULL_BATCH=8 GRPO_BATCH=16 GRPO_GENERATIONS=8 MAX_LENGTH=1024
fi
BF16=$([[ $DEVICE == cpu ]] && echo false || echo true)

stage env python - <<'PY'
import torch, transformers, trl, peft
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
print("transformers", transformers.__version__, "trl", trl.__version__, "peft", peft.__version__)
PY
# float32 against bf16 per decoding step, for models built on the GPU and built on the CPU and moved (plain generate
# and the engine's batcher): where bf16's slowdown comes from (scripts/probe_bf16_decode.py)
# shellcheck disable=SC2086
stage decode-probe python scripts/probe_bf16_decode.py --tokenizer "$PROBE_FOLDER" --device "$DEVICE" $PROBE \
  --out "$OUT/decode_probe.json"
# shellcheck disable=SC2086
stage generate-135m overstory bench generate --config configs/bench/generate-gpu.yaml model="$MODEL" \
  role.device="$DEVICE" $GEN tracking.backend=none out="$OUT/generate-135m"
# shellcheck disable=SC2086
stage generate-1.7b overstory bench generate --config configs/bench/generate-gpu.yaml model="$MODEL_LARGE" \
  role.device="$DEVICE" $GEN_LARGE tracking.backend=none out="$OUT/generate-1.7b"
# shellcheck disable=SC2086
stage generate-teacher overstory bench generate --config configs/bench/generate-gpu.yaml model="$MODEL_TEACHER" \
  role.device="$DEVICE" $GEN_LARGE tracking.backend=none out="$OUT/generate-teacher"

RECIPES="recipes={
  sft-lora-135m-fp32: {job: planner_sft, config: configs/train/planner_sft.yaml, overrides: [model=$MODEL, traces=$TRACES, train.max_steps=$SFT_STEPS, train.batch_size=$SFT_BATCH, train.max_length=$MAX_LENGTH, train.val_fraction=0, train.logging_steps=10, train.bf16=false]},
  sft-lora-135m-bf16: {job: planner_sft, config: configs/train/planner_sft.yaml, overrides: [model=$MODEL, traces=$TRACES, train.max_steps=$SFT_STEPS, train.batch_size=$SFT_BATCH, train.max_length=$MAX_LENGTH, train.val_fraction=0, train.logging_steps=10, train.bf16=$BF16]},
  sft-full-1.7b-bf16: {job: planner_sft, config: configs/train/planner_sft.yaml, overrides: [model=$MODEL_LARGE, traces=$TRACES, lora.enabled=false, train.lr=1.0e-5, train.max_steps=$FULL_STEPS, train.batch_size=$FULL_BATCH, train.max_length=$MAX_LENGTH, train.val_fraction=0, train.logging_steps=5, train.bf16=$BF16]},
  grpo-lora-135m-bf16: {job: planner_grpo, config: configs/train/planner_grpo.yaml, overrides: [model=$MODEL, data.labels=$LABELS, train.max_steps=$GRPO_STEPS, train.batch_size=$GRPO_BATCH, train.num_generations=$GRPO_GENERATIONS, train.bf16=$BF16, train.save_steps=100]}}"
stage train overstory bench train --config configs/bench/train-gpu.yaml "$RECIPES" peak_tflops="$PEAK_TFLOPS" \
  tracking.backend=none out="$OUT/train"
# the paper-scale GRPO recipe's policy (full fine-tuning in bf16, 8 rollouts of up to 128 tokens per prompt) at the
# teacher's shape, rollouts from transformers generate and rewards without R_QA (no stack on this machine)
TEACHER_RECIPES="recipes={
  grpo-full-teacher-bf16: {job: planner_grpo, config: configs/train/planner_grpo.yaml, overrides: [model=$MODEL_TEACHER, data.labels=$LABELS, lora.enabled=false, train.lr=1.0e-6, train.max_steps=$TEACHER_GRPO_STEPS, train.batch_size=$GRPO_BATCH, train.num_generations=$GRPO_GENERATIONS, train.bf16=$BF16, train.save_steps=100]}}"
stage train-teacher overstory bench train --config configs/bench/train-gpu.yaml "$TEACHER_RECIPES" \
  peak_tflops="$PEAK_TFLOPS" tracking.backend=none out="$OUT/train-teacher"
echo "== summary"
cat "$SUMMARY"
