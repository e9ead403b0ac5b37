#!/usr/bin/env bash
# TRAIN HOST(S): train on every rollout exactly once, in order, as it becomes READY (the
# consumption cursor RUN/cursors/train.json), publishing checkpoints/N and weights/N.
#
# One node:
#   export SLIMECTL_RUN_DIR=/shared/runs/a
#   examples/multinode/train_host.sh
# Several nodes (train.tp*pp*dp ranks spread evenly; the same command on each node):
#   NNODES=2 NODE_RANK=0 TRAIN_MASTER_ADDR=10.0.0.1 TRAIN_MASTER_PORT=29500 examples/multinode/train_host.sh --set train.dp=16
#   NNODES=2 NODE_RANK=1 TRAIN_MASTER_ADDR=10.0.0.1 TRAIN_MASTER_PORT=29500 examples/multinode/train_host.sh --set train.dp=16
#
#   TRAIN_MASTER_ADDR  node 0's address, reachable from every train node; TRAIN_MASTER_PORT a
#                      free port on it (open between the train nodes, like NCCL's own ports)
# Further arguments go to `slimectl train`. Restartable at any time: it resumes from the last
# checkpoint and never trains a rollout twice (the train lock: one trainer per run).
ROLE=train
source "$(dirname "$0")/common.sh"

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
args=(train -r "$SLIMECTL_RUN_DIR" --follow --allow-empty --nnodes "$NNODES" --node-rank "$NODE_RANK")
if (( NNODES > 1 )); then
  : "${TRAIN_MASTER_ADDR:?set TRAIN_MASTER_ADDR to the address of train node 0}" "${TRAIN_MASTER_PORT:?set TRAIN_MASTER_PORT to a free port on train node 0}"
  args+=(--master-addr "$TRAIN_MASTER_ADDR" --master-port "$TRAIN_MASTER_PORT")
fi
[[ -n $WAIT_TIMEOUT ]] && args+=(--wait-timeout "$WAIT_TIMEOUT")
say "training node $NODE_RANK of $NNODES"
exec $SLIMECTL "${args[@]}" "$@"
