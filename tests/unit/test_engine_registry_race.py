"""The engine registry's records under concurrent writers (#48): a sync recording a weight version and a ``serve``
registering the engine it started again (same id, new pid) read, change and write a record under one lock, so
neither loses the other's field; and which engines a sync must bring to its version (those a serve restarts)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import time

from slimectl.contract.rundir.atomic import host_id, process_create_time
from slimectl.contract.rundir.registry import EngineRecord, EngineRegistry

N = 150  # writes per writer: without the lock, a lost field shows within a few dozen (measured: see the note)


def _record(pid: int, version: str, create_time: float) -> EngineRecord:
    # on another host: no process lookups, the record's fields are what the writers put there
    return EngineRecord(url="http://127.0.0.1:9", backend="embedded", host="elsewhere", host_id="elsewhere", pid=pid,
                        create_time=create_time, weight_version=version, id="e0")


def _syncs(engines_dir: str) -> None:
    """A sync: weight versions 1..N recorded one after the other."""
    reg = EngineRegistry(engines_dir)
    for v in range(1, N + 1):
        reg.set_weight_version(["e0"], str(v))


def _re_registers(engines_dir: str, started: float) -> None:
    """A serve healing the engine again and again: each time a new pid, at version 0 (what it checked before)."""
    reg = EngineRegistry(engines_dir)
    for pid in range(1001, 1001 + N):
        reg.register(_record(pid, "0", started))


def test_a_version_write_and_a_re_register_lose_neither_field(tmp_path):
    """Two processes hammer one record: the pid never goes back (a version write does not clobber a new pid) and the
    version never goes back (a re-register keeps the newer version a sync recorded after its process started);
    the record ends with the last pid and the last version."""
    reg = EngineRegistry(tmp_path / "engines")
    started = time.time() - 1.0  # the engine's (each new) process started before any of the syncs below
    reg.register(_record(1000, "0", started))
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_syncs, args=(str(reg.dir),)),
               ctx.Process(target=_re_registers, args=(str(reg.dir), started))]
    for w in writers:
        w.start()
    seen = []
    while any(w.is_alive() for w in writers):
        rec = reg.get("e0")
        seen.append((rec.pid, int(rec.weight_version)))
    for w in writers:
        w.join()
        assert w.exitcode == 0
    final = reg.get("e0")
    seen.append((final.pid, int(final.weight_version)))
    pids, versions = [p for p, _ in seen], [v for _, v in seen]
    assert pids == sorted(pids), "a version write put back an older pid"
    assert versions == sorted(versions), "a re-register put back an older version"
    assert (final.pid, final.weight_version) == (1000 + N, str(N))


def test_a_re_register_keeps_only_a_version_synced_after_its_process_started(tmp_path):
    """A newer version recorded before the new process started was the old process's: the engine restarted at an
    older one (its weights were not on disk) says so; one recorded after it started reached it and is kept."""
    reg = EngineRegistry(tmp_path / "engines")
    reg.register(_record(1, "0", 100.0))
    reg.set_weight_version(["e0"], "3")
    written = reg.get("e0").version_set
    reg.register(_record(2, "2", written + 10))  # started after the write: restarted at 2
    assert reg.get("e0").weight_version == "2"
    reg.set_weight_version(["e0"], "4")
    reg.register(_record(3, "2", reg.get("e0").version_set - 10))  # started before the write: synced to 4 since
    assert reg.get("e0").weight_version == "4"
    reg.register(_record(3, "2", 0.0))  # the same process registered again: its own word
    assert reg.get("e0").weight_version == "2"


def test_a_sync_targets_the_engines_its_serve_is_restarting(tmp_path):
    """A record on a dead process is one a sync must wait for while the serve that owns it heals its engines (its
    heartbeat on, itself alive); not when the heartbeat is off (nothing will restart it)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    reg = EngineRegistry(tmp_path / "engines")
    owner = {"pid": os.getpid(), "create_time": process_create_time()}
    for rid, heals in (("healed", True), ("not-healed", False)):
        reg.register(EngineRecord(url="http://127.0.0.1:9", backend="embedded", pid=dead.pid, id=rid,
                                  extra={"owner": owner, "heals": heals}))
    assert reg.live() == []
    assert [r.id for r in reg.live_or_healing()] == ["healed"]
    assert [r.id for r in reg.require_live(healing=True)] == ["healed"]


def test_a_hold_counts_while_its_process_lives_or_until_its_deadline_on_another_host(tmp_path):
    """``EngineRegistry.hold``/``held``: held while the block runs, not after; a hold file of a dead process on this
    host is no hold (and is removed); one from another host counts until its ``until``."""
    import json

    reg = EngineRegistry(tmp_path / "engines")
    assert not reg.held()
    with reg.hold(60):
        assert reg.held()
    assert not reg.held() and not list((tmp_path / "engines" / ".holds").glob("*.json"))
    holds = tmp_path / "engines" / ".holds"
    dead = subprocess.Popen(["true"])
    dead.wait()
    (holds / "dead.json").write_text(json.dumps({"pid": dead.pid, "create_time": 1.0, "host_id": host_id(),
                                                 "host": "x", "until": time.time() + 60}))
    assert not reg.held() and not (holds / "dead.json").exists()
    far = {"pid": 1, "create_time": 1.0, "host_id": "elsewhere", "host": "elsewhere"}
    (holds / "far.json").write_text(json.dumps({**far, "until": time.time() + 60}))
    assert reg.held()
    (holds / "far.json").write_text(json.dumps({**far, "until": time.time() - 1}))
    assert not reg.held() and not (holds / "far.json").exists()
    (holds / "junk.json").write_text(json.dumps(["not", "a", "hold"]))  # a file no hold() wrote: none, removed
    assert not reg.held() and not (holds / "junk.json").exists()
