#!/bin/bash
# REINFORCE++ on one GPU, no Ray job: the flags inline, with a custom loss and context parallelism.
python train.py --actor-num-nodes 1 --actor-num-gpus-per-node 1 --colocate \
    --hf-checkpoint ./Llama-3.2-1B-Instruct \
    --prompt-data ./data/train.jsonl --label-key solution \
    --rm-type ifbench --num-epoch 2 --rollout-batch-size 8 --n-samples-per-prompt 4 \
    --rollout-max-response-len 512 \
    --advantage-estimator reinforce_plus_plus --disable-rewards-normalization --gamma 0.99 \
    --kl-coef 0.01 --use-kl-loss --kl-loss-coef 0.001 --kl-loss-type k3 \
    --custom-loss-function-path my_pkg.losses.my_loss \
    --context-parallel-size 2 \
    --lr 2e-6 --lr-decay-style constant --weight-decay 0.0 \
    --some-flag-from-the-future 3
