"""``rl --launcher ray`` with a real SGLang engine (CPU), ``kill -9``ed and healed (#48): the engine actor's SGLang
server is killed as rollout 1 begins on weight version 1 (held stopped a moment first, so the rollout's requests
are in flight on it); the driver's heartbeat finds it lost, a new actor kills what is left of its process tree
(the scheduler and detokenizer), starts SGLang again on the same URL from ``weights/1`` at weight version 1, checks it
(SGLang's Qwen2 reads no weights back, so the check's read-back is skipped with a warning: the version is checked)
and registers it again; the rollout's requests wait for it and are regenerated whole, and the syncs of versions 2 and 3 reach it.

Local Ray (``rl`` starts its own instance, as tests/e2e/test_ray_engine_heal.py's run does), one engine, the tiny
Qwen2 of test_sglang_rl.py, 3 rollouts. Two SGLang starts (the engine's, the heal's): ~45 s each on an idle 2-core
machine."""

from __future__ import annotations

import re
import threading
import time

import psutil
import pytest
import yaml

from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import SAMPLES_FILE, read_samples
from tests.conformance.sglang_helpers import CPU_ARGS, START_TIMEOUT, sglang_env, sglang_pids
from tests.helpers import read_jsonl, write_config
from tests.integration.test_engine_heal import assert_rollouts_exact, signal_engine_mid_rollout, wait_engine_at_version

pytestmark = [pytest.mark.xdist_group("sglang"), pytest.mark.slow]

HEALTH_CHECK = {"first_wait": 0, "interval": 0.5, "timeout": 20}
"""The heartbeat: fast, with a ``timeout`` far above a ``/health_generate`` of the tiny model on CPU, so a busy
machine does not make the engine look hung (test_sglang_heal.py's)."""


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _starts(log: str) -> list[tuple[str, str]]:
    """The SGLang server starts an engine log records (slimectl's ``# slimectl: starting`` line, then SGLang's
    ready line): the ``--model-path`` and ``--weight-version`` of each start that got ready."""
    starts = re.findall(r"^# slimectl: starting engine-\d+: .*?--model-path (\S+) .*?--weight-version (\S+)", log, re.M)
    assert log.count("The server is fired up and ready to roll!") == len(starts), log[-3000:]
    return starts


def _kill_when_on_version_1(path, killed: dict) -> None:
    """Once engine-0 serves weight version 1, ``kill -9`` its SGLang server (held stopped a moment first: requests
    in flight); then wait for its record on a new pid. What happened goes in ``killed``."""
    rec = wait_engine_at_version(path, "engine-0", None, timeout=START_TIMEOUT)
    server = psutil.Process(rec.pid)
    killed["url"], killed["cmdline"] = rec.url, " ".join(server.cmdline())
    killed["tree"] = [server, *server.children(recursive=True)]  # the server, its scheduler and detokenizer
    killed["pid"] = signal_engine_mid_rollout(path, "engine-0", "1")
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        back = next((r for r in RunDir.open(path).engines.list() if r.pid != killed["pid"]), None)
        if back is not None:
            killed["back"] = back
            killed["back_cmdline"] = " ".join(psutil.Process(back.pid).cmdline())
            return
        time.sleep(0.1)


def test_rl_on_ray_heals_a_killed_sglang_engine(tmp_path, sglang_python, stage_forks, figures):
    n_rollout, batch, n = 3, 2, 4
    cfg = write_config(tmp_path, rollout={"num_rollout": n_rollout, "batch_size": batch, "n_samples_per_prompt": n},
                       engine={"backend": "sglang", "sglang_python": sglang_python, "health_check": HEALTH_CHECK,
                               "sglang_args": yaml.safe_load(CPU_ARGS), "startup_timeout_s": START_TIMEOUT})
    path = tmp_path / "run"
    killed: dict = {}
    killer = threading.Thread(target=_kill_when_on_version_1, args=(path, killed), daemon=True)
    killer.start()
    t0 = time.monotonic()
    res = stage_forks.slimectl("rl", "-c", cfg, "-r", path, "--tiny-model", "qwen2", "--launcher", "ray",
                               out_dir=tmp_path, env=sglang_env(sglang_python), timeout=3 * START_TIMEOUT)
    figures["rl_wall_s"] = round(time.monotonic() - t0, 1)
    killer.join(timeout=5)
    err = res.stderr
    assert res.returncode == 0, err[-4000:]
    assert "sglang.launch_server" in killed.get("cmdline", ""), killed  # a real SGLang server was killed
    assert len(killed["tree"]) >= 3, killed["tree"]  # with its scheduler and detokenizer
    url = re.escape(killed["url"])
    assert re.search(rf"engine-0 at {url} is lost: (its process exited|GET /health_generate did not answer)"
                     rf".*killing its Ray actor", err), err[-3000:]
    # (SGLang's Qwen2 cannot read its weights back: the heal says so instead of "checked")
    back = re.search(rf"engine-0 at {url} is back at weight version 1 \(its version checked; its weights could not "
                     rf"be read back\) in actor \S+ \(pid \d+\), ([\d.]+)s after", err)
    assert back, err[-3000:]
    figures["heal_s"] = float(back.group(1))
    # its record again, on a new SGLang server at the same URL; nothing of the old server's tree left
    rec = killed["back"]
    assert rec.url == killed["url"] and rec.pid != killed["pid"] and rec.weight_version == "1", rec
    assert "sglang.launch_server" in killed["back_cmdline"]
    # the rollout's requests on it failed over to nothing, waited for the heal and went to the new server
    assert "no engine left" in err, err[-3000:]
    assert re.search(rf"engine \S+ is back at {re.escape(rec.url.rstrip('/'))} \(registered again, pid {rec.pid}\)",
                     err), err[-3000:]
    assert all(_gone(p) for p in killed["tree"]), [p for p in killed["tree"] if not _gone(p)]
    run = RunDir.open(path)
    starts = _starts((run.path / "logs" / "engine-0.log").read_text())
    assert len(starts) == 2 and starts[1] == (str(run.weights.dir_for(1)), "1"), starts  # the heal: weights/1, whole
    assert_rollouts_exact(run, n_rollout, batch, n)  # each group once, with exactly its samples
    assert run.cursor("train").read().consumed == list(range(n_rollout))
    # rollout N generated on version N (1 and 2 by the healed engine), and the last sync reached it
    assert [run.rollouts.get(i).meta["weight_version"] for i in range(n_rollout)] == ["0", "1", "2"]
    for i in range(n_rollout):  # every sample's tokens, as SGLang reported them: rollout 1's by the healed server
        samples = read_samples(run.rollouts.get(i).file(SAMPLES_FILE))
        assert {v for s in samples for v in s.weight_versions} == {str(i)}, (i, [s.weight_versions for s in samples])
    syncs = [(int(r["sync/weight_version"]), int(r["sync/num_engines"])) for r in read_jsonl(run.metrics_path("sync"))]
    assert syncs[-1] == (n_rollout, 1), syncs  # (a sync ends once each engine reports the new version)
    assert run.engines.list() == [] and sglang_pids(run) == []  # rl stopped its engine
