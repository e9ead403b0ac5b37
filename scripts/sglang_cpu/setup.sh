#!/usr/bin/env bash
# Build (once) and reuse a venv that runs the REAL SGLang 0.5.23 server on CPU: slimectl's test backend
# for SGLang (docs/sglang-on-cpu.md). Not a production setup: on GPUs install SGLang the normal way.
#
# Usage: scripts/sglang_cpu/setup.sh              build or reuse; the last stdout line is the venv's python
#        scripts/sglang_cpu/setup.sh --print-path print the venv directory (built or not) and exit
#        scripts/sglang_cpu/setup.sh --check      exit 0 when the cached venv exists, 1 otherwise (no build)
#
# Where: ${SLIMECTL_SGLANG_VENV:-$HOME/.cache/slimectl/sglang-cpu-<key>}. <key> hashes every file of this
# recipe (this script, requirements.txt, stubs/) and the Python version, so editing the recipe builds a new
# venv and an unchanged recipe reuses the old one. The build goes to a temporary directory next to it,
# which is renamed into place only after the import check passed: a killed build never leaves a half venv
# where the tests look (its leftovers are removed by the next build). Concurrent builds wait on a lock.
#
# What it installs (all with --no-deps, so pip never pulls a CUDA torch, flashinfer or sglang-kernel):
#  - torch==2.13.0, CPU build. On this machine's package index `torch==2.13.0` resolves to the CPU wheel;
#    on an ordinary runner (PyPI's torch is the CUDA build) set
#      SLIMECTL_SGLANG_TORCH_INDEX=https://download.pytorch.org/whl/cpu
#  - sglang==0.5.23 with --no-deps (its metadata pins torch==2.14.1 and CUDA-only kernels);
#  - the pinned dependencies in requirements.txt;
#  - stubs/sgl_kernel: our stand-in for the CUDA-only kernel package (every kernel raises if called);
#  - stubs/_slimectl_tv_cpu_shim.py, loaded by a .pth file: lets PyPI's CUDA-linked torchvision import next
#    to CPU torch (torchvision from the CPU index does not need it);
#  - stubs/_slimectl_sgl_ops_shim.py, loaded by a .pth file: the four sgl_kernel CPU operator names that
#    SGLang's Qwen-VL multimodal processor needs to import (each raises if called).
# Env: PYTHON (default python3.11; sglang 0.5.23 ships cp311 wheels only here), SLIMECTL_SGLANG_VENV,
#      SLIMECTL_SGLANG_TORCH_INDEX, SGLANG_SPEC (default sglang==0.5.23; a local wheel path works too).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3.11}
SGLANG_SPEC=${SGLANG_SPEC:-sglang==0.5.23}
TORCH_SPEC=torch==2.13.0

BUILD_STEPS=2  # bump when build() below changes what ends up in the venv (this file's options do not count)

recipe_key() {
  # what the venv is made of: the pins and the stubs (name and content, in a fixed order), the build
  # steps' version, the specs and the interpreter's version
  ( cd "$HERE" && find requirements.txt stubs -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 \
      | LC_ALL=C sort -z | xargs -0 sha256sum
    echo "$BUILD_STEPS $SGLANG_SPEC $TORCH_SPEC ${SLIMECTL_SGLANG_TORCH_INDEX:-}"
    "$PY" -c 'import sys; print(sys.version)' ) | sha256sum | cut -c1-16
}

die() { echo "setup.sh: $*" >&2; exit 1; }
if [ "${1:-}" = "--background" ] && ! command -v "$PY" >/dev/null 2>&1; then
  echo "setup.sh: $PY not found: no SGLang venv is built (the conformance suite will say so)" >&2; exit 0
fi
command -v "$PY" >/dev/null 2>&1 || die "$PY not found (SGLang 0.5.23 needs Python 3.11 here; set PYTHON=...)"
V=${SLIMECTL_SGLANG_VENV:-$HOME/.cache/slimectl/sglang-cpu-$(recipe_key)}
IMPORT_CHECK='import sglang, sgl_kernel; from sglang.srt.entrypoints.http_server import app; import torch
import sglang.srt.multimodal.processors.qwen_vl  # SGLang serves Qwen-VL models only with it
print("torch", torch.__version__, "sglang", sglang.__version__, "sgl_kernel", sgl_kernel.__version__)'

case "${1:-}" in
  --print-path) echo "$V"; exit 0 ;;
  --check) [ -x "$V/bin/python" ]; exit $? ;;
  --building)                              # exit 0 while a build holds the lock (a waiter will get the venv)
    [ -e "$V.lock" ] || exit 1
    exec 9<"$V.lock"; if flock -n 9; then exit 1; else exit 0; fi ;;
  --background)                            # build (or reuse) in the background, log in $V.build.log; returns
    [ -x "$V/bin/python" ] && { echo "$V/bin/python"; exit 0; }   # once the build holds its lock
    mkdir -p "$(dirname "$V")"
    nohup bash "$HERE/setup.sh" > "$V.build.log" 2>&1 < /dev/null &
    for _ in $(seq 1 100); do
      if [ -x "$V/bin/python" ] || bash "$HERE/setup.sh" --building; then break; fi
      sleep 0.1
    done
    echo "building $V in the background (log: $V.build.log)" >&2; exit 0 ;;
  "") ;;
  *) die "unknown option ${1} (use --print-path, --check, --building, --background or nothing)" ;;
esac

t0=$(date +%s)
if [ -x "$V/bin/python" ]; then
  echo "reusing $V ($(( $(date +%s) - t0 ))s)" >&2
  echo "$V/bin/python"; exit 0
fi

mkdir -p "$(dirname "$V")"
exec 9>"$V.lock"
flock 9                                    # one builder at a time; a waiter then finds the venv built
if [ -x "$V/bin/python" ]; then
  echo "reusing $V (built by another process while we waited)" >&2
  echo "$V/bin/python"; exit 0
fi
rm -rf "$V".tmp-*                          # what killed builds left behind (we hold the lock)
T="$V.tmp-$$"
trap 'rm -rf "$T"' EXIT
echo "building $V (takes minutes; log: $T.log)" >&2
build() {
  "$PY" -m venv "$T"
  P=("$T/bin/python" -m pip install -q --disable-pip-version-check)
  if [ -n "${SLIMECTL_SGLANG_TORCH_INDEX:-}" ]; then
    "${P[@]}" --no-deps --index-url "$SLIMECTL_SGLANG_TORCH_INDEX" "$TORCH_SPEC"
  else
    "${P[@]}" --no-deps "$TORCH_SPEC"
  fi
  "${P[@]}" --no-deps "$SGLANG_SPEC"
  "${P[@]}" --no-deps -r "$HERE/requirements.txt"
  SP=$("$T/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rm -rf "$SP/sgl_kernel"
  cp -r "$HERE/stubs/sgl_kernel" "$SP/sgl_kernel"
  find "$SP/sgl_kernel" -name __pycache__ -prune -exec rm -rf {} +
  cp "$HERE/stubs/_slimectl_tv_cpu_shim.py" "$SP/"
  echo "import _slimectl_tv_cpu_shim" > "$SP/zz_slimectl_tv_cpu_shim.pth"
  cp "$HERE/stubs/_slimectl_sgl_ops_shim.py" "$SP/"
  echo "import _slimectl_sgl_ops_shim" > "$SP/zz_slimectl_sgl_ops_shim.pth"
  # scripts in bin/ name the temporary directory in their shebangs: point them at the final place
  { grep -rlIF -- "$T" "$T/bin" || true; } | while IFS= read -r f; do sed -i "s#$T#$V#g" "$f"; done
}
set +e; ( set -e; build ) > "$T.log" 2>&1; rc=$?; set -e   # (-e would be ignored inside `build || ...`)
if [ $rc -ne 0 ]; then tail -30 "$T.log" >&2; rm -f "$T.log"; die "build failed (exit $rc; log tail above)"; fi
rm -f "$T.log"
SGLANG_USE_CPU_ENGINE=1 "$T/bin/python" -c "$IMPORT_CHECK" >&2 || die "import check failed; nothing installed at $V"
mv -T "$T" "$V"                            # atomic: the venv appears whole or not at all
trap - EXIT
echo "built $V in $(( $(date +%s) - t0 ))s" >&2
echo "$V/bin/python"
