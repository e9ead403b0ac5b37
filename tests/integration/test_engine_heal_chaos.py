"""The chaos test (#48): ``rl`` over 3 engines of its own while a seeded schedule ``kill -9``s one engine and
``SIGSTOP``s (hangs) another in the middle of rollouts. Nothing is lost and nothing runs twice: every rollout
holds exactly its samples, no group lands twice; the heartbeat replaces both engines, and the last sync reaches
all 3 with its weights read back (``sync.verify``). ``bench/chaos.py`` is the same at 2,000 requests, with the
throughput lost."""

from __future__ import annotations

import random
import re
import signal
import threading

import pytest

from slimectl.contract.rundir import RunDir
from tests.helpers import read_jsonl, slimectl_in_process, write_config
from tests.integration.test_engine_heal import FAST, assert_rollouts_exact, signal_engine_mid_rollout

pytestmark = pytest.mark.xdist_group("engine_heal")

SEED = 48


def chaos_schedule(seed: int, engines: int) -> list[tuple[str, int, str]]:
    """(weight version to wait for, engine index, kill|stop) for one kill -9 and one SIGSTOP on two different
    engines, which and in which order picked by ``seed``; each lands in the rollout on that version, with requests
    in flight on its engine."""
    rng = random.Random(seed)
    killed, stopped = rng.sample(range(engines), 2)
    faults = [(killed, "kill"), (stopped, "stop")]
    rng.shuffle(faults)
    return [(str(v), idx, kind) for v, (idx, kind) in enumerate(faults, start=1)]


def inject(path, schedule, done: list) -> None:
    """Apply ``schedule`` to the run at ``path``."""
    for version, idx, kind in schedule:
        signal_engine_mid_rollout(path, f"engine-{idx}", version, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        done.append((idx, kind))


@pytest.mark.slow
def test_rl_under_a_seeded_chaos_schedule_loses_and_repeats_nothing(tmp_path):
    n_rollout, batch, n, engines = 4, 8, 8, 3  # 256 samples, a request each
    schedule = chaos_schedule(SEED, engines)
    cfg = write_config(tmp_path, rollout={"num_rollout": n_rollout, "batch_size": batch, "n_samples_per_prompt": n,
                                          "max_response_len": 16},
                       engine={"num_engines": engines, "health_check": FAST},
                       sync={"verify": True, "timeout_s": 30})
    path = tmp_path / "run"
    done: list = []
    faults = threading.Thread(target=inject, args=(path, schedule, done), daemon=True)
    faults.start()
    res = slimectl_in_process("rl", "-c", cfg, "-r", path, "--tiny-model", "qwen2")
    faults.join(timeout=5)
    assert res.returncode == 0, res.stderr[-3000:]
    assert done == [(i, k) for _, i, k in schedule], (done, schedule)
    err = res.stderr
    killed, stopped = (next(i for _, i, k in schedule if k == kind) for kind in ("kill", "stop"))
    assert re.search(rf"engine-{killed} at \S+ is lost: (its process exited|GET /health_generate did not answer)",
                     err), err[-3000:]
    assert re.search(rf"engine-{stopped} at \S+ is lost: GET /health_generate did not answer 200 within 2s \(hung\)",
                     err), err[-3000:]
    assert err.count("retrying its requests on the 2 other engine(s)") >= 2, err[-3000:]  # both mid-rollout
    for idx in (killed, stopped):
        assert re.search(rf"engine-{idx} at \S+ is back at weight version \d+ \(checked\)", err), err[-3000:]
    run = RunDir.open(path)
    assert_rollouts_exact(run, n_rollout, batch, n)
    syncs = [(int(r["sync/weight_version"]), int(r["sync/num_engines"])) for r in read_jsonl(run.metrics_path("sync"))]
    assert syncs[-1] == (n_rollout, engines)  # the last sync reached (and read back, sync.verify) every engine
    assert run.engines.list() == []
