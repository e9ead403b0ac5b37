#!/usr/bin/env bash
# ROLLOUT HOST: generate rollouts/N for N = next .. rollout.num_rollout-1 on the registered
# engines. Rollout N starts once every engine serves weight version >= N - ROLLOUT_LAG (the sync
# loop pushes them), so no weight update ever lands in the middle of a rollout.
#
#   export SLIMECTL_RUN_DIR=/shared/runs/a SLIMECTL_ENGINE_TOKEN=...   # see common.sh
#   examples/multinode/rollout_host.sh [--set rollout.temperature=0.8 ...]
#
# Further arguments go to `slimectl rollout`. Restartable at any time (after a kill -9 too): it
# resumes at the first rollout that is not READY; the rollout stage lock keeps a second copy out.
ROLE=rollout
source "$(dirname "$0")/common.sh"

total=$(query num-rollout)
while :; do
  n=$(query next-rollout)
  (( n < total )) || break
  need=$(( n > ROLLOUT_LAG ? n - ROLLOUT_LAG : 0 ))
  say "rollout $n: waiting for the engines to serve weight version >= $need"
  wait_for engines "$need"
  say "rollout $n: generating"
  $SLIMECTL rollout -r "$SLIMECTL_RUN_DIR" --id "$n" --set rollout.max_staleness="$ROLLOUT_LAG" "$@"
done
say "all $total rollouts are published"
