"""bench/sync.py — `slimectl sync` of a ~100M-parameter model vs the bare data movement, same run.

An embedded engine (its own process, as `slimectl serve` starts it) serves a random Llama of
~100M parameters (fp32). Four measurements, each the median of ``--runs``:

- distributed:  ``sync_engines`` with the distributed transport (gloo on CPU): pause, flush,
                begin, one ``/update_weights_from_distributed`` per bucket while the tensors are
                broadcast, end, continue, version check — and the engine copies them into its model.
- broadcast:    the floor: the same tensors broadcast over a bare gloo group to a receiver
                process that allocates them (no HTTP, no copy into a model).
- disk:         ``sync_engines`` with the disk transport on a weights directory written just
                before (publish included: HF safetensors written and fsynced, then the engine
                loads them through ``/update_weights_from_disk``).
- files:        the floor: write the same safetensors (fsynced) and read every tensor back.

Prints ratios distributed/broadcast and disk/files. Targets: <= 1.3 each.

    python bench/sync.py [--runs 3] [--hidden 768 --layers 12 --vocab 16000] [--bucket-mb 512]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECEIVER = r"""
import sys, torch, torch.distributed as dist
from datetime import timedelta
from slimectl.engines.weight_group import init_custom_process_group
port, shapes = int(sys.argv[1]), eval(sys.argv[2])
pg = init_custom_process_group("127.0.0.1", port, 1, 2, "floor", "gloo", 600)
for _ in range(int(sys.argv[3])):
    for s in shapes:
        t = torch.empty(s)
        dist.broadcast(t, src=0, group=pg)
    dist.barrier(group=pg)
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsync_dir(d: Path) -> None:
    for f in d.iterdir():
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--bucket-mb", type=int, default=512)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    from slimectl.contract.config_schema import SyncSection
    from slimectl.engines.client import EngineClient
    from slimectl.engines.weight_group import init_custom_process_group
    from slimectl.starter_models.tiny_models import build_tiny_model
    from slimectl.backends.megatron.checkpoint import copy_hf_aux_files
    from slimectl.backends.hf.checkpoint import write_safetensors_sharded
    from slimectl.stages.sync import WeightSource, sync_engines
    from slimectl.stages.sync.disk import DiskTransport
    from slimectl.stages.sync.distributed import DistributedTransport

    work = Path(tempfile.mkdtemp(prefix="slimectl-bench-sync-"))
    h = args.hidden
    model = build_tiny_model("llama", work / "hf", hidden_size=h, num_layers=args.layers, num_heads=h // 64,
                             num_kv_heads=max(1, h // 256), intermediate_size=int(h * 8 / 3) // 64 * 64,
                             vocab_size=args.vocab)
    tensors = load_file(str(model / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"model: {sum(t.numel() for t in tensors.values()) / 1e6:.1f}M parameters, {nbytes / 1e6:.0f} MB fp32, "
          f"{len(tensors)} tensors", file=sys.stderr)
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "slimectl.engines.embedded.server", "--model-path", str(model),
                               "--port", str(port), "--weight-version", "0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    times: dict[str, list[float]] = {"distributed": [], "broadcast": [], "disk": [], "files": []}
    phases: list[dict[str, float]] = []
    try:
        async def run_syncs() -> None:
            async with EngineClient(url) as c:
                await c.wait_healthy(timeout=300)
                clients = {url: c}
                dist_tr = DistributedTransport(SyncSection(transport="distributed", bucket_size_mb=args.bucket_mb))
                await dist_tr.connect(clients)
                version = 0
                for _ in range(args.runs):
                    version += 1
                    t0 = time.perf_counter()
                    res = await sync_engines(clients, dist_tr, WeightSource.from_tensors(version, lambda: tensors.items()))
                    times["distributed"].append(time.perf_counter() - t0)
                    phases.append(res.phases)
                    version += 1
                    d = work / f"weights-{version}"
                    t0 = time.perf_counter()
                    d.mkdir()
                    write_safetensors_sharded(tensors.items(), d)
                    copy_hf_aux_files(model, d)
                    fsync_dir(d)
                    await sync_engines(clients, DiskTransport(), WeightSource.from_dir(version, d))
                    times["disk"].append(time.perf_counter() - t0)
                await dist_tr.close(clients)

        asyncio.run(run_syncs())
    finally:
        engine.terminate()
        engine.wait(60)

    # Floors, in the same run.
    shapes = [list(t.shape) for t in tensors.values()]
    fport = free_port()
    recv = subprocess.Popen([sys.executable, "-c", RECEIVER, str(fport), repr(shapes), str(args.runs)])
    pg = init_custom_process_group("127.0.0.1", fport, 0, 2, "floor", "gloo", 600)
    for _ in range(args.runs):
        t0 = time.perf_counter()
        for t in tensors.values():
            dist.broadcast(t, src=0, group=pg)
        dist.barrier(group=pg)
        times["broadcast"].append(time.perf_counter() - t0)
    recv.wait(60)
    for i in range(args.runs):
        f = work / f"floor-{i}.safetensors"
        t0 = time.perf_counter()
        save_file(tensors, str(f))
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
        back = load_file(str(f))
        _ = sum(float(t.view(-1)[0]) for t in back.values())  # touch every tensor
        times["files"].append(time.perf_counter() - t0)

    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:12s} median {v:.3f} s over {len(times[k])} runs ({nbytes / v / 1e9:.2f} GB/s)")
    print("distributed phases (median s): " + ", ".join(
        f"{k} {statistics.median(p[k] for p in phases):.3f}" for k in phases[0]))
    print(f"distributed / broadcast = {med['distributed'] / med['broadcast']:.2f} (target <= 1.3)")
    print(f"disk / files            = {med['disk'] / med['files']:.2f} (target <= 1.3)")
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    del torch


if __name__ == "__main__":
    main()
