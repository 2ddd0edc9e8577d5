#!/usr/bin/env bash
# The planner on gold levels, end to end (issue 13): gold labels -> NarrativeQA pseudo-labels -> the mix and its
# held-out side -> template traces -> SFT -> GRPO and STITCH with R_QA -> eval planner per dataset.
#   bash scripts/planner_gold_pipeline.sh            (from the repository root, after `make env vllm-env`)
# Every step is resumable (the data jobs skip finished ids, the recipes resume from their newest checkpoint), so
# a killed run is continued by running the script again. CPU figures: ~2 h 30 min on 2 cores, most of it in the
# pseudo-labels (vLLM on CPU, ~3 questions/min), SFT (~40 s/step) and the evaluation. Knobs, as environment
# variables: NQA_LIMIT (NarrativeQA questions to pseudo-label), SFT_STEPS, GRPO_STEPS, STITCH_STEPS, COMPARE.
set -euo pipefail
NQA_LIMIT=${NQA_LIMIT:-120}
SFT_STEPS=${SFT_STEPS:-30}
GRPO_STEPS=${GRPO_STEPS:-4}
STITCH_STEPS=${STITCH_STEPS:-4}
COMPARE=${COMPARE:-base,sft,grpo,stitch}
MIX=runs/data/planner_mix-gold
SFT=runs/train/planner_sft-gold

overstory data gold-labels --config configs/data/gold_labels-full.yaml
overstory data pseudo-labels --config configs/data/pseudo_labels-narrativeqa-full.yaml limit="$NQA_LIMIT" \
  concurrency=8 serve.engine=vllm 'serve.vllm_args=[--enforce-eager]' serve.vllm_env.VLLM_CPU_KVCACHE_SPACE=2 \
  serve.vllm_env.VLLM_CPU_OMP_THREADS_BIND=0-1
overstory data mix --config configs/data/planner_mix-gold.yaml
overstory data mix --config configs/data/planner_eval-gold.yaml
overstory data traces --config configs/data/traces.yaml labels=$MIX/labels.jsonl out=$MIX/traces.jsonl \
  'teachers={template: {kind: template}}' metadata_tokens=128
overstory train planner_sft --config configs/train/planner_sft.yaml traces=$MIX/traces.jsonl out=$SFT \
  train.epochs=1 train.max_steps="$SFT_STEPS" train.lr=1e-3 train.max_length=512 train.logging_steps=10 \
  train.save_steps=10
overstory train planner_grpo --config configs/train/planner_grpo.yaml data.labels=$MIX/labels.jsonl \
  data.metadata_tokens=128 model=$SFT/final out=runs/train/planner_grpo-gold rewards.qa=1.0 correctness.rule=f1 \
  train.max_steps="$GRPO_STEPS" train.save_steps=2
overstory train stitch --config configs/train/stitch.yaml data.labels=$MIX/labels.jsonl traces=$MIX/traces.jsonl \
  model=$SFT/final data.metadata_tokens=128 out=runs/train/stitch-gold stitch.steps="$STITCH_STEPS" \
  stitch.questions_per_step=4 stitch.imitation_threshold=4 rewards.qa=1.0 correctness.rule=f1
overstory eval planner --config configs/eval/planner-gold.yaml --compare "$COMPARE"
