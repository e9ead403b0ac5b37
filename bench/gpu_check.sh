#!/usr/bin/env bash
# bench/gpu_check.sh — the prepared GPU check (issue #9): a real engine and the Megatron trainer
# on a small model (Qwen2 layout, hidden 512, 8 layers, bf16) for a few `slimectl rl` steps with
# the distributed weight sync, then one block with the step time, rollout tokens/s, sync seconds
# and the train-vs-rollout log-prob difference (bench/gpu_summary.py, from the run's metrics).
#
#   bash bench/gpu_check.sh                    on a GPU machine, from the repository root
#   bash bench/gpu_check.sh --cpu              the same flow on CPU with a tiny model (no installs)
#   bash bench/gpu_check.sh --download-wheels  on a machine that reaches PyPI: fetch into .whl/ the
#                                              wheels a GPU image without a registry lacks; carry .whl
#                                              with the checkout (and `echo /.whl/ >> .git/info/exclude`)
#
# Every step runs under `timeout`, and the whole check under BUDGET_S (default 480 s): a step that
# cannot finish in what is left is skipped and reported, never waited for. What it decides:
#
# * Python: $PYTHON (default python3) must have torch with CUDA. Missing pure dependencies
#   (megatron-core, pydantic, ...) go into a private site directory, WORK/site, on PYTHONPATH, from
#   .whl/ when present, else from the package index (10 s network timeout, no retries). slimectl
#   itself is copied there. No venv: one made from an image's venv interpreter would not see its torch.
# * Engine: SGLang when `import sglang` works, or when `pip install "$SGLANG_SPEC"` (default
#   sglang[all]>=0.5; .whl/sglang/ first) finishes within its limit, into WORK/sglang-site (SGLang
#   pins its own torch, so only the engine process sees that directory). Otherwise the embedded
#   engine (CPU), and the summary says so.
# * Weight sync: the distributed transport. NCCL when the engine is SGLang on a GPU of its own
#   (2+ GPUs: trainer on GPU 0, engine on GPU 1). NCCL refuses two ranks on one GPU ("Duplicate GPU
#   detected"), so with one GPU the trainer and SGLang use gloo over the same GPU (FORCE_NCCL=1
#   tries NCCL anyway); the embedded engine lives on the CPU, which NCCL cannot reach: gloo.
#
# Environment: PYTHON, WORK (default /tmp/slimectl-gpu-check), WHEELS (default .whl), STEPS (4),
# BUDGET_S (480), SGLANG_SPEC, FORCE_NCCL. When $OUT is a directory, summary.txt and logs.tar.gz
# are copied there. Exit status: 0 the figures were printed, 1 the check ran and failed, 2 it
# could not be set up.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODE=gpu
case ${1:-} in
  "") ;;
  --cpu) MODE=cpu ;;
  --download-wheels) MODE=wheels ;;
  -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) echo "gpu_check.sh: unknown option '$1' (--cpu, --download-wheels or --help)" >&2; exit 2 ;;
esac

if [[ $MODE == cpu && -z ${PYTHON:-} && -x $ROOT/.venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; fi
PYTHON=${PYTHON:-python3}
WORK=${WORK:-/tmp/slimectl-gpu-check}
WHEELS=${WHEELS:-$ROOT/.whl}
STEPS=${STEPS:-4}
BUDGET_S=${BUDGET_S:-480}
SGLANG_SPEC=${SGLANG_SPEC:-sglang[all]>=0.5}
FORCE_NCCL=${FORCE_NCCL:-0}
# The versions this project is tested with; --download-wheels takes the local ones when it can.
PINS=(megatron-core==0.16.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
      "typing-extensions>=4.16")
NOTES=()

say() { echo "[gpu_check ${SECONDS}s] $*" >&2; }
note() { NOTES+=("$*"); say "note: $*"; }
die() { say "ERROR: $*"; exit "${2:-2}"; }

# step LIMIT_S NAME CMD...: run CMD under timeout (LIMIT_S, or what is left of BUDGET_S), its
# output in WORK/NAME.log; on failure print the log's tail. Returns CMD's status (124: timed out).
step() {
  local limit=$1 name=$2 left rc
  shift 2
  left=$(( BUDGET_S - SECONDS - 20 ))  # 20 s stay for the summary
  (( left < limit )) && limit=$left
  if (( limit < 5 )); then say "$name: skipped, the time budget (BUDGET_S=$BUDGET_S) is spent"; return 124; fi
  say "$name (at most ${limit}s)"
  timeout --kill-after=15 "$limit" "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  if (( rc == 124 || rc == 137 )); then
    say "$name: TIMED OUT after ${limit}s; the end of $WORK/$name.log:"
    tail -n 20 "$WORK/$name.log" >&2
    return 124
  elif (( rc != 0 )); then
    say "$name: FAILED (exit $rc); the end of $WORK/$name.log:"
    tail -n 20 "$WORK/$name.log" >&2
  fi
  return $rc
}

mkdir -p "$WORK" || die "cannot create WORK=$WORK"
command -v timeout >/dev/null || die "coreutils 'timeout' is missing"
command -v "$PYTHON" >/dev/null || [[ -x $PYTHON ]] || die "no Python interpreter '$PYTHON' (set PYTHON)"

# ------------------------------------------------------------------------------ --download-wheels
if [[ $MODE == wheels ]]; then
  mkdir -p "$WHEELS"
  mapfile -t local_pins < <("$PYTHON" - "${PINS[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for spec in sys.argv[1:]:
    name = spec.split("=")[0].split(">")[0]
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(spec)
EOF
)
  say "downloading ${local_pins[*]} (CPython 3.12, manylinux x86_64) into $WHEELS"
  step 300 download-wheels "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" "${local_pins[@]}" || die "pip download failed; see $WORK/download-wheels.log" 1
  ls -l "$WHEELS" >&2
  say "done: carry $WHEELS with the checkout; SGLang (GBs) is not fetched: put its wheels in $WHEELS/sglang/ to use it"
  exit 0
fi

# ------------------------------------------------------------------------------ the machine
RUN=$WORK/run
rm -rf "$RUN" "$WORK/model" "$WORK"/*.log
probe=$(timeout 120 "$PYTHON" -c "import torch; print(torch.__version__, int(torch.cuda.is_available()), torch.cuda.device_count())" 2>&1 | tail -n 1)
read -r TORCH_VERSION HAS_CUDA NGPU <<<"$probe"
[[ ${NGPU:-} =~ ^[0-9]+$ ]] || die "$PYTHON cannot import torch: $probe"
say "python $("$PYTHON" -c 'import sys; print(sys.version.split()[0])'), torch $TORCH_VERSION, CUDA available: $HAS_CUDA, GPUs: $NGPU"
if [[ $MODE == gpu ]]; then
  (( HAS_CUDA == 1 )) || die "torch sees no CUDA device: run this on a GPU machine, or use --cpu"
  timeout 20 nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader >&2 2>/dev/null || true
fi

# ------------------------------------------------------------------------------ dependencies
SITE=$WORK/site
rm -rf "$SITE" && mkdir -p "$SITE"
cp -r "$ROOT/slimectl" "$SITE/slimectl" && cp -r "$ROOT/commands" "$SITE/slimectl/commands" \
  || die "cannot copy slimectl into $SITE"
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
missing() {
  "$PYTHON" - <<'EOF'
import importlib.util
need = {"megatron.core": "megatron-core", "pydantic": "pydantic", "yaml": "pyyaml", "click": "click",
        "aiohttp": "aiohttp", "pyarrow": "pyarrow", "psutil": "psutil", "transformers": "transformers",
        "safetensors": "safetensors", "sympy": "sympy", "tqdm": "tqdm", "accelerate": "accelerate"}
out = []
for mod, pkg in need.items():
    try:
        found = importlib.util.find_spec(mod) is not None
    except ImportError:
        found = False
    if not found:
        out.append(pkg)
print(" ".join(out))
EOF
}
MISSING=$(missing)
if [[ -n $MISSING && $MODE == gpu ]]; then
  say "not importable: $MISSING"
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    step 180 install-deps "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl
  else
    step 180 install-deps "$PYTHON" -m pip install -q --no-deps --no-compile --timeout 10 --retries 0 --target "$SITE" "${PINS[@]}"
  fi
  MISSING=$(missing)
fi
[[ -z $MISSING ]] || die "still missing: $MISSING. On a machine that reaches PyPI run \`bash bench/gpu_check.sh --download-wheels\` and bring .whl/ along"
"$PYTHON" -c "import slimectl.commands.cli" 2>"$WORK/import.log" || { tail -n 5 "$WORK/import.log" >&2; die "slimectl does not import"; }

# ------------------------------------------------------------------------------ the engine
ENGINE=embedded
SGLANG_PYTHON=""
if [[ $MODE == gpu ]]; then
  if "$PYTHON" -c "import sglang" 2>/dev/null; then
    ENGINE=sglang
  else
    SG=$WORK/sglang-site
    mkdir -p "$SG"
    if [[ -d $WHEELS/sglang ]]; then
      step 240 install-sglang "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS/sglang" --target "$SG" "$SGLANG_SPEC"
    else
      step 240 install-sglang "$PYTHON" -m pip install -q --timeout 10 --retries 0 --target "$SG" "$SGLANG_SPEC"
    fi
    if (( $? == 0 )) && PYTHONPATH=$SG:$PYTHONPATH timeout 120 "$PYTHON" -c "import sglang" 2>/dev/null; then
      ENGINE=sglang
      SGLANG_PYTHON=$WORK/sglang-python  # the engine alone sees SGLang's own torch
      printf '#!/bin/sh\nexport PYTHONPATH=%s:%s\nexec %s "$@"\n' "$SG" "$PYTHONPATH" \
        "$(command -v "$PYTHON" || echo "$PYTHON")" >"$SGLANG_PYTHON"
      chmod +x "$SGLANG_PYTHON"
    else
      note "SGLang could not be installed (see $WORK/install-sglang.log): the embedded engine (CPU) stands in for it"
    fi
  fi
fi

if [[ $ENGINE == sglang ]]; then
  if (( NGPU >= 2 )); then
    SYNC_BACKEND=nccl
    GPU_IDS="[1]"
    MEM_FRACTION=0.8
  else
    GPU_IDS="[0]"
    MEM_FRACTION=0.4
    if (( FORCE_NCCL == 1 )); then
      SYNC_BACKEND=nccl
      note "FORCE_NCCL=1: NCCL between two processes on one GPU (NCCL normally refuses: duplicate GPU)"
    else
      SYNC_BACKEND=gloo
      note "one GPU: NCCL refuses two ranks on one GPU, so the weight sync used gloo over that GPU; NCCL needs a second GPU"
    fi
  fi
else
  SYNC_BACKEND=gloo
  [[ $MODE == gpu ]] && note "the embedded engine runs on the CPU, out of NCCL's reach: the weight sync used gloo (NCCL was not exercised)"
fi

# ------------------------------------------------------------------------------ model and config
if [[ $MODE == gpu ]]; then
  HIDDEN=512 LAYERS=8 HEADS=8 KV=4 FFN=1408 MODEL_DTYPE=bfloat16 RUN_DTYPE=bf16
  if [[ $ENGINE == sglang ]]; then BATCH=16 N=8 RESP=128; else BATCH=8 N=8 RESP=64; fi
else
  HIDDEN=64 LAYERS=2 HEADS=4 KV=2 FFN=128 MODEL_DTYPE=float32 RUN_DTYPE=fp32 BATCH=2 N=4 RESP=8
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
step 180 build-model "$PYTHON" -c "
from slimectl.starter_models.tiny_models import build_tiny_model
build_tiny_model('qwen2', '$WORK/model', hidden_size=$HIDDEN, num_layers=$LAYERS, num_heads=$HEADS,
                 num_kv_heads=$KV, intermediate_size=$FFN, dtype='$MODEL_DTYPE', seed=0)
" || die "could not build the model" 1

ENGINE_YAML="backend: $ENGINE"
if [[ $ENGINE == sglang ]]; then
  ENGINE_YAML="$ENGINE_YAML
  gpu_ids: $GPU_IDS
  mem_fraction_static: $MEM_FRACTION
  startup_timeout_s: 300
  sglang_args: {disable_cuda_graph: true}"
  [[ -n $SGLANG_PYTHON ]] && ENGINE_YAML="$ENGINE_YAML
  sglang_python: $SGLANG_PYTHON"
fi
cat >"$WORK/config.yaml" <<EOF
name: gpu-check
model: {path: $WORK/model, dtype: $RUN_DTYPE}
data: {prompt_data: $ROOT/examples/data/arith.jsonl}
rollout: {num_rollout: $STEPS, batch_size: $BATCH, n_samples_per_prompt: $N, max_response_len: $RESP, reward: random}
engine:
  $ENGINE_YAML
train: {lr: 1.0e-5, save_interval: 1000, keep_checkpoints: 1}
sync: {transport: distributed, backend: $SYNC_BACKEND, master_addr: 127.0.0.1, timeout_s: 120, keep_weights: 1}
logging: {tensorboard: false, progress: "off"}
EOF

# ------------------------------------------------------------------------------ the run
stop_leftover_engines() {  # engines of a killed `rl` (SGLang runs in its own session: stop its group)
  local f pid
  for f in "$RUN"/engines/*.json; do
    [[ -e $f ]] || continue
    pid=$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1])).get('pid') or '')" "$f" 2>/dev/null)
    [[ $pid =~ ^[0-9]+$ ]] && kill -TERM -- "-$pid" 2>/dev/null
  done
}
trap stop_leftover_engines EXIT

T0=$SECONDS
step 90 init "$PYTHON" -m slimectl init "$RUN" -c "$WORK/config.yaml" || die "slimectl init failed" 1
step 420 rl "$PYTHON" -m slimectl rl -r "$RUN"
RL_RC=$?
RL_S=$(( SECONDS - T0 ))
stop_leftover_engines
(( RL_RC == 0 )) || note "slimectl rl did not finish (exit $RL_RC, see $WORK/rl.log): the figures cover the steps it completed"
grep -E "weight-update group|using .* engine|resuming at" "$WORK/rl.log" >&2 2>/dev/null

ENGINE_LABEL=$ENGINE
[[ $ENGINE == sglang ]] && ENGINE_LABEL="sglang (GPU $GPU_IDS, mem_fraction_static $MEM_FRACTION)"
[[ $ENGINE == embedded ]] && ENGINE_LABEL="embedded (CPU)"
NOTES+=("model: qwen2 layout, hidden $HIDDEN, $LAYERS layers, $RUN_DTYPE; $STEPS steps of $BATCH prompts x $N samples x <= $RESP tokens; init + rl took ${RL_S}s, the whole check ${SECONDS}s")
args=()
for n in "${NOTES[@]}"; do args+=(--note "$n"); done
"$PYTHON" "$ROOT/bench/gpu_summary.py" "$RUN" --title "slimectl GPU check ($MODE)" --engine "$ENGINE_LABEL" \
  --sync "distributed, $SYNC_BACKEND" "${args[@]}" | tee "$WORK/summary.txt"
SUMMARY_RC=${PIPESTATUS[0]}

if [[ -n ${OUT:-} && -d ${OUT:-} ]]; then
  cp "$WORK/summary.txt" "$OUT/" 2>/dev/null
  tar -czf "$OUT/logs.tar.gz" -C "$WORK" $(cd "$WORK" && ls *.log config.yaml 2>/dev/null) \
    $(cd "$WORK" && ls -d run/metrics run/logs 2>/dev/null) 2>/dev/null
fi
(( RL_RC == 0 && SUMMARY_RC == 0 )) || exit 1
exit 0
