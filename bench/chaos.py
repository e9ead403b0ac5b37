"""Chaos bench (#48): requests through the engine pool while a seeded schedule ``kill -9``s and ``SIGSTOP``s
(hangs) the engines, against the same requests without faults, in one script.

    python bench/chaos.py [--requests 2000] [--engines 3] [--faults 4] [--seed 0] [--out FILE.json]

Three embedded engines of a tiny Qwen2 (built offline), launched and watched as ``serve`` does
(:class:`~slimectl.stages.serve.EngineProcesses` with ``engine.health_check``: first_wait 0, interval 0.5 s,
timeout 5 s). The requests go in rounds of ``--round`` (a rollout's worth; each round a fresh
:class:`~slimectl.engines.pool.EnginePool` over the engines not lost, as ``rl`` builds one per rollout). The
fault thread waits until every engine is back, then, at seeded moments, sends SIGKILL or SIGSTOP to a seeded
engine's process. Reported: requests answered (exactly once each: every id once), faults injected, the
heartbeat's detection time per fault, requests retried (attempts beyond one per request), the engines'
versions at the end, and the throughput of both passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slimectl.engines.pool import EnginePool  # noqa: E402
from slimectl.stages.init import init_run  # noqa: E402
from slimectl.stages.serve import EngineProcesses  # noqa: E402
from slimectl.starter_models.tiny_models import build_tiny_model  # noqa: E402

HEALTH = {"first_wait": 0, "interval": 0.5, "timeout": 5}


async def _round(urls: list[str], ids: range, max_new_tokens: int) -> tuple[dict[int, int], int]:
    """Send requests ``ids`` through a fresh pool; ({id: times answered}, attempts made)."""
    pool = EnginePool(urls, concurrency_per_engine=32, timeout=120.0)
    answered: dict[int, int] = {}

    async def one(i: int) -> None:
        await pool.generate(input_ids=[1 + i % 50, 2 + i % 7, 3], rid=f"chaos-{i}",
                            sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0})
        answered[i] = answered.get(i, 0) + 1

    try:
        await asyncio.gather(*(one(i) for i in ids))
    finally:
        await pool.close()
    return answered, sum(pool.requests.values())


def drive(group: EngineProcesses, n: int, per_round: int, max_new_tokens: int) -> dict:
    answered: dict[int, int] = {}
    attempts = 0
    t0 = time.perf_counter()
    for start in range(0, n, per_round):
        urls = [u for u in group.urls if u not in group.lost]
        got, tried = asyncio.run(_round(urls, range(start, min(n, start + per_round)), max_new_tokens))
        for i, k in got.items():
            answered[i] = answered.get(i, 0) + k
        attempts += tried
    seconds = time.perf_counter() - t0
    return {"requests": n, "answered": len(answered), "answered_twice": sum(k > 1 for k in answered.values()),
            "missing": n - len(answered), "attempts": attempts, "retried": attempts - n,
            "seconds": round(seconds, 2), "requests_per_s": round(n / seconds, 1)}


def _all_back(group: EngineProcesses, count: int) -> bool:
    procs = [p for p in group.supervisor.processes if p.name.startswith("engine-")]
    registered = {e.pid for e in group.engines}  # an engine being started again is not registered yet
    return len(procs) == count and all(p.returncode() is None and p.pid in registered for p in procs)


def inject(group: EngineProcesses, schedule: list[tuple[float, int, str]], done: threading.Event,
           injected: list[dict]) -> None:
    """Apply ``schedule`` ((seconds after the last engine came back, engine index, kill|stop)), one fault at a
    time: each waits until the heartbeat found the one before, and every engine runs and is registered again."""
    count = len(group.engine_indices)
    gone: set[int] = set()  # the pids faults were injected into: each must be replaced before the next fault
    for delay, idx, kind in schedule:
        for wait in (0.0, delay):
            if done.wait(wait):
                return
            while not _all_back(group, count) or gone & {p.pid for p in group.supervisor.processes}:
                if done.wait(0.05):
                    return
        proc = group.supervisor.find(f"engine-{idx}")
        if proc is None:
            continue
        at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        injected.append({"engine": idx, "kind": kind, "at": at, "pid": proc.pid})
        gone.add(proc.pid)
        while not any(x.name == f"engine-{idx}" and x.at >= at for x in list(getattr(group.watcher, "losses", []))):
            if done.wait(0.05):  # a stopped engine still looks alive until the heartbeat finds it
                return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--round", type=int, default=200, help="requests per pool (a rollout's worth)")
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--faults", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    tmp = Path(tempfile.mkdtemp(prefix="slimectl-chaos-"))
    model = build_tiny_model("qwen2", tmp / "model")
    hc = [f"engine.health_check.{k}={v}" for k, v in HEALTH.items()]
    run = init_run(tmp / "run", overrides=[f"model.path={model}", f"engine.num_engines={args.engines}", *hc]).run
    group = EngineProcesses(run, run.config()).start()
    try:
        clean = drive(group, args.requests, args.round, args.max_new_tokens)
        rng = random.Random(args.seed)
        schedule = [(rng.uniform(0.5, 3.0), rng.randrange(args.engines), rng.choice(["kill", "stop"]))
                    for _ in range(args.faults)]
        done, injected = threading.Event(), []
        faults = threading.Thread(target=inject, args=(group, schedule, done, injected), daemon=True)
        faults.start()
        chaos = drive(group, args.requests, args.round, args.max_new_tokens)
        done.set()
        faults.join()
        deadline = time.monotonic() + 300
        while not (_all_back(group, args.engines) or group.lost) and time.monotonic() < deadline:
            time.sleep(0.1)
        losses = list(group.watcher.losses)
        detect = []
        for f in injected:  # the first loss of that engine after the fault
            hit = next((x for x in losses if x.name == f"engine-{f['engine']}" and x.at >= f["at"]), None)
            detect.append(round(hit.at - f["at"], 2) if hit else None)
        versions = {r.id: r.weight_version for r in run.engines.list()}
    finally:
        group.stop()
    report = {"engines": args.engines, "seed": args.seed, "schedule": schedule, "clean": clean, "chaos": chaos,
              "faults_injected": [{k: v for k, v in f.items() if k != "at"} for f in injected],
              "detection_s": detect, "losses": len(losses), "lost_for_good": list(group.lost.values()),
              "versions_at_end": versions,
              "throughput_lost": round(1 - chaos["requests_per_s"] / clean["requests_per_s"], 3)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
