# Sourced by the role scripts beside it: the settings every host shares.
#
#   SLIMECTL_RUN_DIR      the run directory on the shared filesystem, the same absolute path on
#                         every host (required)
#   SLIMECTL_ENGINE_TOKEN the engines' admin token; the same value on the serve, rollout and
#                         sync hosts (required when the engines bind a non-loopback interface)
#   SLIMECTL              how to call slimectl (default: slimectl; e.g. "python -m slimectl")
#   PYTHON                an interpreter with slimectl installed, for wait_for.py (default: python3)
#   ROLLOUT_LAG           0: rollout N is generated on weight version N (on-policy, the default);
#                         1: on version N-1, so rollout N overlaps training on N-1 (one-step-off).
#                         Set the same value on the rollout and sync hosts.
#   WAIT_TIMEOUT          seconds a host waits for another one before giving up (default: forever)
set -euo pipefail

: "${SLIMECTL_RUN_DIR:?set SLIMECTL_RUN_DIR to the run directory on the shared filesystem (same absolute path on every host)}"
export SLIMECTL_RUN_DIR
SLIMECTL=${SLIMECTL:-slimectl}
PYTHON=${PYTHON:-python3}
ROLLOUT_LAG=${ROLLOUT_LAG:-0}
WAIT_TIMEOUT=${WAIT_TIMEOUT:-}
MULTINODE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

case $ROLLOUT_LAG in 0|1) ;; *) echo "ROLLOUT_LAG must be 0 or 1, not '$ROLLOUT_LAG'" >&2; exit 2 ;; esac

say() { echo "[$(date +%H:%M:%S) ${ROLE:-?}@$(hostname)] $*" >&2; }

# wait_for ready KIND ID | wait_for engines VERSION: block (up to WAIT_TIMEOUT) on the shared run dir.
wait_for() { $PYTHON "$MULTINODE_DIR/wait_for.py" "$@" ${WAIT_TIMEOUT:+--timeout "$WAIT_TIMEOUT"}; }

# query next-rollout | engine-version | num-rollout: print one number read from the run dir.
query() { $PYTHON "$MULTINODE_DIR/wait_for.py" "$1"; }
