#!/usr/bin/env bash
# LATTICE end to end on the shipped HotpotQA sample (issue 14): the LLM-built tree -> teacher traversal traces ->
# the scorer students (LoRA LLM, cross-encoder pointwise and listwise, and one trained on gold labels) -> one
# evaluation table of every scorer beside BM25, dense, hybrid and LATTICE++.
#   bash scripts/lattice_pipeline.sh            (from the repository root, after `make env`)
# Every step resumes (a finished tree is kept, the data jobs skip finished ids, the recipes resume from their newest
# checkpoint). CPU sizes:
# ITERATIONS search iterations (the paper: 20), CANDIDATE_CHARS per candidate in a slate prompt, LLM_STEPS for the
# LoRA student (LLM_STUDENT=0 leaves it out: its searches cost as much as the teacher's), TRACE_QUESTIONS traced
# questions (0: all 40). The teacher is the built-in SmolLM2-135M (the paper
# finds scorers under 2B collapse); at scale give the traces job a large teacher:
# serve.roles.scorer.model=Qwen/Qwen3-8B serve.engine=vllm (or server_url=).
set -euo pipefail
ITERATIONS=${ITERATIONS:-6}
CANDIDATE_CHARS=${CANDIDATE_CHARS:-300}
LLM_STEPS=${LLM_STEPS:-40}
TRACE_QUESTIONS=${TRACE_QUESTIONS:-0}
LLM_STUDENT=${LLM_STUDENT:-1}
# TREE_ARGS: overrides of the tree build, e.g. "method=bottom-up" (78 short LLM calls over the 400 leaves, the
# CPU choice) instead of the top-down default (400 leaves' keyword summaries in batches of 20, then LLM clustering)
TREE_ARGS=${TREE_ARGS:-}
DIR=runs/lattice/hotpotqa
SEARCH="search.iterations=$ITERATIONS max_candidate_chars=$CANDIDATE_CHARS max_tokens=256 max_reasoning_chars=200"

# the bottom-up and hybrid builds do not resume: a finished tree is kept (delete $DIR/tree.json to rebuild)
if [[ ! -f $DIR/tree.json ]]; then
  # shellcheck disable=SC2086
  overstory data lattice-tree --config configs/data/lattice_tree.yaml out=$DIR $TREE_ARGS
fi
overstory data lattice-tree-stats tree=$DIR/tree.json
# shellcheck disable=SC2086
overstory data lattice-traces --config configs/data/lattice_traces.yaml tree=$DIR/tree.json out=$DIR/traces.jsonl \
  $SEARCH batch_queries=10 limit="$TRACE_QUESTIONS"
COMPARE=oracle,teacher,ce_pointwise,ce_pointwise_nocal,ce_listwise,ce_gold,bm25,dense,hybrid,lattice++
HELDOUT=runs/train/distill_scorer-ce_pointwise  # every student splits the traced questions alike (by query hash)
if [[ $LLM_STUDENT == 1 ]]; then
  overstory train distill-scorer --config configs/train/distill_scorer_llm.yaml traces=$DIR/traces.jsonl \
    max_candidate_chars="$CANDIDATE_CHARS" max_reasoning_chars=200 train.max_steps="$LLM_STEPS" train.logging_steps=5
  COMPARE=${COMPARE/teacher,/teacher,llm_student,}
fi
overstory train distill-scorer --config configs/train/distill_scorer_cross_encoder.yaml traces=$DIR/traces.jsonl \
  max_candidate_chars="$CANDIDATE_CHARS"
overstory train distill-scorer --config configs/train/distill_scorer_cross_encoder.yaml traces=$DIR/traces.jsonl \
  max_candidate_chars="$CANDIDATE_CHARS" loss=listwise out=runs/train/distill_scorer-ce_listwise
overstory train distill-scorer --config configs/train/distill_scorer_cross_encoder.yaml traces=$DIR/traces.jsonl \
  max_candidate_chars="$CANDIDATE_CHARS" targets=gold out=runs/train/distill_scorer-ce_gold
# shellcheck disable=SC2086
overstory eval lattice --config configs/eval/lattice.yaml tree=$DIR/tree.json agreement_traces=$DIR/traces.jsonl \
  heldout_from=$HELDOUT $SEARCH --compare "$COMPARE"
