#!/usr/bin/env bash
# SERVE HOST: start the inference engines, register them in RUN/engines/ with an address the
# other hosts can reach, and keep them up (SIGINT/SIGTERM stops them, leaving no orphans).
#
#   export SLIMECTL_RUN_DIR=/shared/runs/a SLIMECTL_ENGINE_TOKEN=...   # see common.sh
#   examples/multinode/serve_host.sh --backend sglang --num-engines 8 --set engine.gpu_ids=[0,1,2,3,4,5,6,7]
#
#   SERVE_BIND      interface the engines bind (default 0.0.0.0: every interface)
#   ADVERTISE_HOST  the address other hosts use for this one (default: its address on the
#                   default route; set it when the hosts talk over another network)
# Further arguments go to `slimectl serve`. Open the engine ports (engine.port .. +num_engines-1;
# set --port, since 0 picks random ones) to the rollout and sync hosts.
ROLE=serve
source "$(dirname "$0")/common.sh"

bind=${SERVE_BIND:-0.0.0.0}
case $bind in
  127.*|localhost|::1) ;;
  *) : "${SLIMECTL_ENGINE_TOKEN:?engines reachable from other hosts need an admin token: export SLIMECTL_ENGINE_TOKEN (the same on the rollout and sync hosts)}" ;;
esac
say "serving the engines of $SLIMECTL_RUN_DIR on $bind"
exec $SLIMECTL serve -r "$SLIMECTL_RUN_DIR" --host "$bind" ${ADVERTISE_HOST:+--advertise-host "$ADVERTISE_HOST"} "$@"
