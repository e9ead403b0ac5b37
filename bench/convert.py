"""bench/convert.py — `slimectl convert` of a ~100M-parameter random model vs the I/O floor.

The floor, measured in the same run on the same files: read every tensor of the HF safetensors
and write the same bytes to a new safetensors file, fsynced (convert's output is durable too). Each measurement runs in a fresh process
(imports excluded from the timed region); memory is the peak PSS of the process tree above the
post-import baseline, sampled every 20 ms in a separate run (sampling would slow the timed run). Prints medians of N runs and the ratios
convert/floor (time) and convert-peak/model-size (memory). Targets: <= 2.0x time, <= 1.5x size.

    python bench/convert.py [--runs 3] [--hidden 768 --layers 12 --vocab 16000] [--family llama|qwen2|qwen3|qwen3-moe]

``--family qwen3-moe`` converts a Qwen3-MoE of the same hidden size and depth (``--experts 8``, top-2,
expert width hidden/2): per-expert HF tensors into Megatron's local experts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[4])
mode, src, dst, watch = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[5] == "mem"
import torch
from _memwatch import PeakMemory
if mode == "floor":
    from safetensors.torch import load_file, save_file
    import os
    def work():
        sd = load_file(src + "/model.safetensors")
        save_file(sd, dst + "/model.safetensors", metadata={"format": "pt"})
        fd = os.open(dst + "/model.safetensors", os.O_RDONLY); os.fsync(fd); os.close(fd)  # durable, as convert is
else:
    from slimectl.stages.convert import convert_hf_to_megatron
    import slimectl.backends.megatron.checkpoint, slimectl.backends.megatron.copy_save, slimectl.backends.megatron.provider, megatron.core.models.gpt, megatron.core.dist_checkpointing  # noqa: import cost outside the timer
    import megatron.core.models.gpt.gpt_layer_specs, megatron.core.dist_checkpointing.strategies.torch  # noqa
    def work():
        convert_hf_to_megatron(src, dst, progress="off")
if watch:
    with PeakMemory() as mem:
        work()
    print("RESULT " + json.dumps({"peak_extra_bytes": mem.peak - mem.baseline}))
else:
    t0 = time.perf_counter(); work(); dt = time.perf_counter() - t0
    print("RESULT " + json.dumps({"seconds": dt}))
"""


def run_worker(mode: str, src: Path, dst: Path, watch: bool) -> dict:
    if mode == "floor":
        dst.mkdir(exist_ok=True)
    # Flush what earlier runs left dirty (and the blocks their deleted outputs freed) so that
    # neither measurement pays for the other's writeback in its own fsync.
    os.sync()
    proc = subprocess.run([sys.executable, "-c", WORKER, mode, str(src), str(dst), str(HERE), "mem" if watch else "time"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} worker failed:\n{proc.stderr[-3000:]}")
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--family", default="llama")
    ap.add_argument("--experts", type=int, default=8, help="experts per layer (--family qwen3-moe)")
    args = ap.parse_args()
    from slimectl.starter_models.tiny_models import build_tiny_model
    from slimectl.backends.hf.arch import arch_from_dir

    work = Path(tempfile.mkdtemp(prefix="slimectl-bench-convert-"))
    try:
        model = build_tiny_model(args.family, work / "hf", hidden_size=args.hidden, num_layers=args.layers,
                                 num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 256),
                                 intermediate_size=int(args.hidden * 8 / 3) // 64 * 64, vocab_size=args.vocab,
                                 **(dict(num_experts=args.experts, num_experts_per_tok=2,
                                         moe_intermediate_size=args.hidden // 2) if args.family == "qwen3-moe" else {}))
        arch = arch_from_dir(model)
        size = (model / "model.safetensors").stat().st_size
        print(f"model: {args.family} {arch.num_params() / 1e6:.1f}M parameters, {size / 2**20:.0f} MiB fp32 safetensors",
              file=sys.stderr)
        floor, conv = [], []
        for i in range(args.runs):
            # Time and memory are measured in separate runs: sampling PSS every 20 ms costs CPU
            # that a 2-core machine would otherwise spend on the work being timed.
            for kind, bucket in (("floor", floor), ("convert", conv)):
                rec = {}
                for watch in (False, True):
                    dst = work / f"{kind}-{i}-{watch}"
                    rec.update(run_worker(kind, model, dst, watch))
                    shutil.rmtree(dst, ignore_errors=True)
                bucket.append(rec)
            print(f"run {i + 1}: floor {floor[-1]['seconds']:.2f} s, convert {conv[-1]['seconds']:.2f} s, "
                  f"convert peak +{conv[-1]['peak_extra_bytes'] / 2**20:.0f} MiB", file=sys.stderr)
        med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
        report = {
            "params_m": round(arch.num_params() / 1e6, 1),
            "model_mib": round(size / 2**20, 1),
            "runs": args.runs,
            "floor_s": round(med(floor, "seconds"), 3),
            "convert_s": round(med(conv, "seconds"), 3),
            "time_ratio": round(med(conv, "seconds") / med(floor, "seconds"), 2),
            "floor_peak_extra_mib": round(med(floor, "peak_extra_bytes") / 2**20, 1),
            "convert_peak_extra_mib": round(med(conv, "peak_extra_bytes") / 2**20, 1),
            "memory_ratio_vs_model": round(med(conv, "peak_extra_bytes") / size, 2),
            "targets": {"time_ratio": 2.0, "memory_ratio_vs_model": 1.5},
        }
        print(json.dumps(report, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
