#!/usr/bin/env bash
# SYNC DRIVER (run it on train node 0): whenever the engines may take a newer weight version,
# push the newest one. Version V may replace the engines' weights once `train` published
# weights/V and the rollout that runs on older weights is READY: rollouts/V-1 (ROLLOUT_LAG=0)
# or rollouts/V (ROLLOUT_LAG=1). So no update ever lands in the middle of a rollout.
#
#   export SLIMECTL_RUN_DIR=/shared/runs/a SLIMECTL_ENGINE_TOKEN=...   # see common.sh
#   examples/multinode/sync_loop.sh                                      # the run's sync.* settings
#   examples/multinode/sync_loop.sh --transport distributed \
#       --set sync.master_addr=10.0.0.1 --set sync.master_port=29600    # NCCL: this host's address
#
# With the distributed transport this process is rank 0 of the weight-update group and every
# engine rank joins it: sync.master_addr must be this host's address as the engines reach it,
# and sync.master_port (plus NCCL's own ports) open to the serve host. The disk transport only
# needs the engines to read RUN/weights/V at the same path. Further arguments go to `slimectl
# sync`. Restartable at any time, and it catches up engines that restarted at version 0: each
# round starts from the lowest version the engines report.
ROLE=sync
source "$(dirname "$0")/common.sh"

total=$(query num-rollout)
while :; do
  v=$(query engine-version)
  if (( v < 0 )); then
    say "waiting for the engines to register"
    wait_for engines 0
    continue
  fi
  (( v < total )) || break
  say "engines at version $v: waiting for a newer version they may take"
  target=$(wait_for sync-target "$v" --lag "$ROLLOUT_LAG")
  say "pushing weight version $target"
  $SLIMECTL sync -r "$SLIMECTL_RUN_DIR" --version "$target" "$@"
done
say "the engines serve the final weight version $total"
