#!/bin/bash
# One-step-off-policy (train_async.py) on two nodes: 8 trainer GPUs on one, 8 engine GPUs on the other.
set -euxo pipefail
SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
. "${SCRIPT_DIR}/models/qwen2.5-1.5B.sh"

MODEL_DIR=/data/models/Qwen2.5-1.5B-Instruct
DATA=/data/gsm8k

ROLLOUT_ARGS=(
   --hf-checkpoint $MODEL_DIR
   --prompt-data $DATA/train.parquet
   --input-key question --label-key answer
   --apply-chat-template
   --rollout-shuffle --rollout-seed 7
   --custom-rm-path my_rewards.gsm8k.reward_fn
   --num-rollout 500
   --rollout-batch-size 64
   --over-sampling-batch-size 96
   --dynamic-sampling-filter-path slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std
   --partial-rollout
   --n-samples-per-prompt 16
   --rollout-max-response-len 1024
   --rollout-stop "</answer>" "Question:"
   --rollout-top-p 0.95
   --num-steps-per-rollout 2
)
EVAL_ARGS=(
   --eval-interval 25
   --eval-prompt-data gsm8k $DATA/test.parquet math500 $DATA/math500.jsonl@[0:200]
   --n-samples-per-eval-prompt 4
   --eval-temperature 0.6
)
ALGO_ARGS=(
   --advantage-estimator gspo
   --eps-clip 3e-4 --eps-clip-high 4e-4
   --use-tis --tis-clip 2.0
   --use-rollout-logprobs
)
OPT=(--lr 5e-7 --lr-warmup-iters 10 --lr-decay-style cosine --min-lr 1e-8 --clip-grad 0.5 --seed 3407)
PAR=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --bf16)
ENG=(
   --rollout-num-gpus 8 --rollout-num-gpus-per-engine 1
   --update-weight-transport nccl --update-weight-buffer-size 1073741824
   --sglang-context-length 4096 --sglang-enable-dp-attention
   --sglang-server-concurrency 256
   --router-policy cache_aware
)
LOG=(--use-wandb --wandb-project gsm8k-async --wandb-group 1.5b --use-tensorboard)

python3 /opt/slime/train_async.py \
   --actor-num-nodes 1 --actor-num-gpus-per-node 8 \
   "${MODEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${ALGO_ARGS[@]}" \
   "${OPT[@]}" "${PAR[@]}" "${ENG[@]}" "${LOG[@]}" 2>&1 | tee /tmp/train.log
