"""bench/delta_sync.py — delta weight sync (``sync.mode: delta``) against full weights, after real RL steps.

For each dtype (bf16, fp32) and lr (1e-6, 1e-5): ``slimectl rl`` on SmolLM2-135M-Instruct (``slimectl init
--pretrained smollm2-135m`` builds it) for ``--steps`` rollouts with ``sync.mode: delta``, so ``weights/N``
carries its delta against ``weights/N-1`` after a real optimizer step. Then one embedded engine (``slimectl
serve``) and, for the last version N, in the same run and process:

- put the engine on N-1 (full), sync N as a delta, then put it back on N-1 and sync N as full weights, by disk and
  over the gloo group: bytes moved (``sync/bytes``), the sync's time and its transfer phase (the engine reading
  and applying: its apply time), ``--runs`` times each, medians;
- what the trainer writes: the delta's bytes against the safetensors', and the time to encode it (read the base,
  XOR or diff, zstd, checksums) against the time to write the full safetensors.

Prints one table and ratios delta/full; the issue's target (#47), in bf16 at lr 1e-6: bytes moved <= 0.1x and a
sync no slower than full.

    python bench/delta_sync.py [--steps 2] [--runs 3] [--encoding xor] [--out results.jsonl] [--keep DIR]

``--keep DIR`` keeps each case's ``rl`` run as ``DIR/<dtype>-<lr>`` and reuses it when it is there (its
``weights/<steps>`` published): the sync figures of two versions of the engine compared on the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}


def rl(work: Path, model: Path, dtype: str, lr: float, a) -> Path:
    """A finished ``slimectl rl`` run with sync.mode delta (weights/1..steps kept)."""
    import yaml

    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"What is {i % 10}+{i // 10}?", "label": str(i % 10 + i // 10)})
                            + "\n" for i in range(64)))
    cfg = {"name": "delta-bench", "model": {"path": str(model), "dtype": dtype},
           "data": {"prompt_data": str(data), "apply_chat_template": True, "shuffle": False},
           "rollout": {"num_rollout": a.steps, "batch_size": a.prompts, "n_samples_per_prompt": a.samples,
                       "max_response_len": a.new_tokens, "temperature": 1.0, "reward": "random", "seed": 1},
           "train": {"lr": lr, "lr_decay_style": "constant"}, "logging": {"tensorboard": False},
           "sync": {"mode": "delta", "delta_encoding": a.encoding, "keep_weights": None}}
    path = work / "rl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = work / "run"
    if (run / "weights" / f"{a.steps:06d}" / "READY").is_file():
        return run  # --keep: this case's run is there already
    p = subprocess.run([sys.executable, "-m", "slimectl", "rl", "-c", str(path), "-r", str(run)], env=ENV,
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"slimectl rl failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return run


def serve(run: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "slimectl", "serve", "-r", str(run)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if not proc.stdout.readline():
        sys.exit("slimectl serve did not announce its engine")
    return proc


def sync_figures(run_path: Path, version: int, runs: int) -> dict[str, dict[str, float]]:
    """Medians of ``runs`` syncs of ``version`` onto an engine on ``version - 1``: delta and full, disk and group."""
    from slimectl.contract.rundir import RunDir
    from slimectl.stages.sync.stage import run_sync

    run = RunDir.open(run_path)
    cfg = run.config()
    modes = {m: cfg.model_copy(update={"sync": cfg.sync.model_copy(update={"mode": m})}) for m in ("delta", "full")}
    out: dict[str, dict[str, list[float]]] = {}
    for _ in range(runs):
        for transport in ("disk", "distributed"):
            for mode, c in modes.items():
                run_sync(run, modes["full"], version - 1, "disk")
                r = run_sync(run, c, version, transport, verify=False)
                f = out.setdefault(f"{mode}/{transport}", {})
                for k, v in (("bytes", r.bytes), ("sync_s", r.seconds), ("apply_s", r.phases["transfer"])):
                    f.setdefault(k, []).append(v)
    check = run_sync(run, modes["full"], version - 1, "disk") and run_sync(run, modes["delta"], version, "disk",
                                                                            verify=True)
    assert check.verified, "the engine's weights after the delta differ from weights/N"
    return {k: {m: statistics.median(v) for m, v in f.items()} for k, f in out.items()}


def write_figures(run_path: Path, version: int, encoding: str) -> dict[str, float]:
    """What the trainer writes for ``version``: full safetensors vs full + delta (bytes and seconds)."""
    from slimectl.backends.hf.checkpoint import HFCheckpoint, write_safetensors_sharded
    from slimectl.backends.hf.weight_delta import DeltaWriter

    w = run_path / "weights"
    new_dir, base_dir = w / f"{version:06d}", w / f"{version - 1:06d}"
    with HFCheckpoint(new_dir) as ckpt:
        tensors = dict(ckpt.iter_tensors())
    with tempfile.TemporaryDirectory(dir=run_path) as tmp:
        t = time.perf_counter()
        write_safetensors_sharded(tensors.items(), tmp)
        full_s = time.perf_counter() - t
        full_bytes = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
    with tempfile.TemporaryDirectory(dir=run_path) as tmp, HFCheckpoint(base_dir) as base:
        t = time.perf_counter()
        writer = DeltaWriter(Path(tmp), version - 1, encoding, "zstd")
        for n, x in tensors.items():
            writer.add(n, base.get(n), x)
        header = writer.close()
        delta_s = time.perf_counter() - t
    changed = sum(e["changed"] for e in header["tensors"])
    total = sum(x.numel() for x in tensors.values())
    return {"full_bytes": full_bytes, "delta_bytes": header["blob_bytes"], "write_full_s": full_s,
            "encode_delta_s": delta_s, "changed_frac": changed / total}


@contextmanager
def case_dir(keep: Path | None, name: str):
    """Where a case's rl run lives: ``keep/name`` (kept) or a temporary directory."""
    if keep is None:
        with tempfile.TemporaryDirectory(prefix="delta-bench-") as work:
            yield Path(work)
        return
    (keep / name).mkdir(parents=True, exist_ok=True)
    yield keep / name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="HF model dir (default: SmolLM2-135M, --pretrained)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--encoding", default="xor", choices=("xor", "overwrite"))
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--out", type=Path, default=None, help="append each case's figures here (JSON lines)")
    ap.add_argument("--keep", type=Path, default=None, help="keep (and reuse) each case's rl run under this directory")
    a = ap.parse_args()
    if a.model is None:
        from slimectl.starter_models.pretrained import ensure_pretrained

        a.model = ensure_pretrained("smollm2-135m")
    rows = []
    for dtype in a.dtypes.split(","):
        for lr in map(float, a.lrs.split(",")):
            with case_dir(a.keep, f"{dtype}-{lr:g}") as work:
                t = time.perf_counter()
                run = rl(Path(work), a.model, dtype, lr, a)
                rl_s = time.perf_counter() - t
                proc = serve(run)
                try:
                    figs = sync_figures(run, a.steps, a.runs)
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
                row = {"dtype": dtype, "lr": lr, "encoding": a.encoding, "version": a.steps, "rl_s": rl_s,
                       **write_figures(run, a.steps, a.encoding), "sync": figs}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(f"\n{'dtype':5} {'lr':>6} {'changed':>8} | {'transport':11} {'delta MB':>9} {'full MB':>8} {'bytes':>6} "
          f"{'delta s':>8} {'full s':>7} {'time':>6} {'apply d/f s':>12}")
    for r in rows:
        for tr in ("disk", "distributed"):
            d, f = r["sync"][f"delta/{tr}"], r["sync"][f"full/{tr}"]
            print(f"{r['dtype']:5} {r['lr']:6.0e} {100 * r['changed_frac']:7.2f}% | {tr:11} {d['bytes'] / 1e6:9.2f} "
                  f"{f['bytes'] / 1e6:8.2f} {d['bytes'] / f['bytes']:5.3f}x {d['sync_s']:8.3f} {f['sync_s']:7.3f} "
                  f"{d['sync_s'] / f['sync_s']:5.2f}x {d['apply_s']:5.3f}/{f['apply_s']:5.3f}")
        print(f"{'':22}| written: delta {r['delta_bytes'] / 1e6:.2f} MB beside {r['full_bytes'] / 1e6:.2f} MB; "
              f"encode {r['encode_delta_s']:.2f} s vs write {r['write_full_s']:.2f} s")


if __name__ == "__main__":
    main()
