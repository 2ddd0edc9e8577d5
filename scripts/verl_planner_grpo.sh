#!/usr/bin/env bash
# GRPO/DAPO for the planner with verl on Ray, from `overstory data verl-export`:
#   bash scripts/verl_planner_grpo.sh runs/verl/planner                      # one node, 8 GPUs
#   NNODES=2 bash scripts/verl_planner_grpo.sh runs/verl/planner              # after `ray start` on every node
# verl goes in its own environment, not the project's .venv: it pins an older transformers than the TRL recipes
# use. Make one and install this package with the `verl` extra there:
#   python -m venv .venv-verl && .venv-verl/bin/pip install -e '.[verl]' && source .venv-verl/bin/activate
# The paper's scale: Qwen2.5-1.5B-Instruct, lr 1e-6, 8 rollouts per prompt, prompt batch 256, mini-batch 64.
# Not yet run here (no GPU was lent to this issue); the export and the reward entry are tested on CPU.
set -euo pipefail
DATA=${1:?usage: verl_planner_grpo.sh EXPORT_DIR [extra hydra overrides]}
shift
MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
ROOT=$(cd "$(dirname "$0")/.." && pwd)

python -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=False \
  data.train_files="$DATA/train.parquet" \
  data.val_files="$DATA/val.parquet" \
  data.prompt_key=prompt \
  data.train_batch_size=256 \
  data.max_prompt_length=1536 \
  data.max_response_length=256 \
  data.filter_overlong_prompts=True \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=64 \
  actor_rollout_ref.actor.loss_agg_mode=token-mean \
  actor_rollout_ref.actor.clip_ratio_low=0.2 \
  actor_rollout_ref.actor.clip_ratio_high=0.28 \
  actor_rollout_ref.actor.use_kl_loss=False \
  actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
  custom_reward_function.path="$ROOT/training/verl/reward.py" \
  custom_reward_function.name=compute_score \
  trainer.project_name=overstory \
  trainer.experiment_name=planner_grpo_dapo \
  trainer.logger='["console","wandb"]' \
  trainer.nnodes="$NNODES" \
  trainer.n_gpus_per_node="$GPUS_PER_NODE" \
  trainer.total_epochs=1 \
  trainer.save_freq=50 \
  trainer.test_freq=25 \
  "$@"
