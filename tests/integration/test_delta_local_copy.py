"""sync.mode delta for engines that cannot apply a delta (#47): the host-local copy the delta brings forward.

SGLang loads full weights only, so the sync keeps a full copy of the run's weights on the engines' host
(``slimectl/weight_formats/local_copy.py``), applies each ``weights/N``'s delta to it and has the engines load
the copy. Here without SGLang (tests/conformance/test_sglang_delta_sync.py has it): the copy itself, and the
format's disk push with SGLang's capabilities to our embedded engine, which loads the copy with the same
``/update_weights_from_disk``. A tiny qwen2 in fp32; versions published the way train publishes them.
"""

from __future__ import annotations

import asyncio
import getpass
import hashlib
import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest

from slimectl.backends.hf.weight_delta import DELTA_FILE, DELTA_META, read_header
from slimectl.contract.rundir import RunDir
from slimectl.engines.caps import EMBEDDED, SGLANG_CPU
from slimectl.weight_formats.delta import DeltaWeights
from slimectl.weight_formats.local_copy import COPY_READY, LocalCopy, LocalCopyError, on_this_host
from tests.helpers import slimectl_in_process, start_engine
from tests.integration.test_delta_sync import assert_engine_holds, publish

pytestmark = pytest.mark.xdist_group("delta_local_copy")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> RunDir:
    """A run with weights/1-5 published as deltas, xor and overwrite in turn."""
    root = tmp_path_factory.mktemp("local-copy")
    res = slimectl_in_process("init", root / "run", "--tiny-model", "qwen2", "--set", "logging.tensorboard=false",
                              "--set", "sync.mode=delta", "--set", "sync.keep_weights=null",
                              "--set", f"sync.local_copy_dir={root / 'copies'}")
    assert res.returncode == 0, res.stderr
    run = RunDir.open(root / "run")
    for v in range(1, 6):
        publish(run, v, seed=v, encoding="xor" if v % 2 else "overwrite")
    return run


def wdir(run: RunDir, v: int) -> Path:
    return run.weights.get(v).path


def sums(d: Path) -> dict[str, str]:
    """sha256 of each safetensors file of a directory."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("*.safetensors"))}


def full_bytes(d: Path) -> int:
    """The bytes of the safetensors of a directory."""
    return sum(p.stat().st_size for p in d.glob("*.safetensors"))


def copied_bytes(copy: Path) -> int:
    """The bytes of the files a copy of the full weights read: its every file but its READY."""
    return sum(p.stat().st_size for p in copy.iterdir() if p.name != COPY_READY)


def delta_only(run: RunDir, v: int, into: Path) -> Path:
    """weights/V's delta files alone, in a directory of their own (no safetensors to read)."""
    into.mkdir(parents=True, exist_ok=True)
    for f in (DELTA_META, DELTA_FILE):
        shutil.copyfile(wdir(run, v) / f, into / f)
    return into


@contextmanager
def safetensors_zeroed(d: Path):
    """``d``'s safetensors overwritten with zeros of the same size (its READY's size check still passes), put back
    after: what reads them gets garbage."""
    kept = {p: p.read_bytes() for p in d.glob("*.safetensors")}
    try:
        for p, data in kept.items():
            p.write_bytes(bytes(len(data)))
        yield
    finally:
        for p, data in kept.items():
            p.write_bytes(data)


def test_five_deltas_on_the_local_copy_rebuild_every_version_bit_for_bit(run, tmp_path):
    """Version 1 copied in full (no copy yet), 2-5 each from the copy before and the delta files alone: each copy's
    safetensors are weights/N's byte for byte, each step reads only the delta, and only the last copy is kept."""
    copy = LocalCopy(tmp_path / "copy")
    state, read = copy.advance(1, wdir(run, 1), read_header(wdir(run, 1)))
    assert read == copied_bytes(state.path) > full_bytes(wdir(run, 1)) and sums(state.path) == sums(wdir(run, 1))
    for v in range(2, 6):
        header = read_header(wdir(run, v))
        src = delta_only(run, v, tmp_path / f"delta-{v}")
        state, read = copy.advance(v, src, header)
        assert (state.version, state.digest) == (v, header["digest"])
        assert read == header["blob_bytes"] + (src / DELTA_META).stat().st_size < full_bytes(wdir(run, v)) / 5
        assert sums(state.path) == sums(wdir(run, v)), f"the local copy differs from weights/{v}"
        assert sorted(p.name for p in copy.root.iterdir()) == [f"v{v:06d}"]
    assert copy.advance(5, wdir(run, 5), read_header(wdir(run, 5)))[1] == 0  # already there: nothing read


def test_a_flipped_byte_fails_loudly_and_the_old_copy_stays(run, tmp_path):
    copy = LocalCopy(tmp_path / "copy")
    old, _ = copy.advance(1, wdir(run, 1), read_header(wdir(run, 1)))
    before = sums(old.path)
    src = delta_only(run, 2, tmp_path / "bad")
    blob = bytearray((src / DELTA_FILE).read_bytes())
    blob[len(blob) // 2] ^= 0x10
    (src / DELTA_FILE).write_bytes(bytes(blob))
    with pytest.raises(LocalCopyError, match=r"does not apply to the local copy .* the copy stays at version 1"):
        copy.advance(2, src, read_header(wdir(run, 2)))
    assert copy.current() == old and sums(old.path) == before
    assert sorted(p.name for p in copy.root.iterdir()) == ["v000001"]  # its temporary directory removed


def test_a_missing_or_damaged_copy_is_made_from_the_full_weights(run, tmp_path):
    """No copy (first sync, a new host): from the full weights/N; a copy whose bytes are not the delta's base
    (damaged): the same, with a warning; a killed sync's leftovers are removed and ignored."""
    copy = LocalCopy(tmp_path / "copy")
    state, read = copy.advance(3, wdir(run, 3), read_header(wdir(run, 3)))
    assert read == copied_bytes(state.path) and sums(state.path) == sums(wdir(run, 3))
    shard = next(state.path.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # a tensor's byte, not the header
    shard.write_bytes(bytes(data))
    leftover = copy.root / ".tmp-v000004-dead"  # what a kill -9 while writing leaves
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    state, read = copy.advance(4, wdir(run, 4), read_header(wdir(run, 4)))
    assert read == copied_bytes(state.path) and sums(state.path) == sums(wdir(run, 4))
    assert sorted(p.name for p in copy.root.iterdir()) == ["v000004"]
    (state.path / COPY_READY).unlink()  # a copy without its READY is no copy
    assert copy.current() is None
    blocked = tmp_path / "a-file"  # a directory that cannot be made: one line naming it and the ways out
    blocked.write_text("")
    with pytest.raises(LocalCopyError, match=r"cannot make the local copy of weight version 4 under .*a-file .*"
                                             r"set sync.local_copy_dir to another host-local directory"):
        LocalCopy(blocked).advance(4, wdir(run, 4), read_header(wdir(run, 4)))


@pytest.mark.parametrize("at", ["rename", "remove"])
def test_a_sync_killed_while_writing_the_copy_leaves_the_old_or_the_new_one(run, tmp_path, at):
    """A process bringing the copy from 1 to 2 is killed (SIGKILL) as it renames the new copy into place, or as it
    removes the old one: the copy is then version 1 or version 2, whole; the next sync removes the leftovers and
    goes on from it with a delta."""
    copy = LocalCopy(tmp_path / "copy")
    copy.advance(1, wdir(run, 1), read_header(wdir(run, 1)))
    src = delta_only(run, 2, tmp_path / "delta-2")
    pid = os.fork()
    if pid == 0:  # the child: the sync that dies there (the patch lives and dies with it)
        try:
            def die(*_args):
                os.kill(os.getpid(), signal.SIGKILL)
            if at == "rename":
                os.rename = die
            else:
                LocalCopy._remove = die
            copy.advance(2, src, read_header(wdir(run, 2)))
        finally:
            os._exit(3)
    assert os.waitpid(pid, 0)[1] == signal.SIGKILL
    left = copy.current()
    want = 1 if at == "rename" else 2
    assert left.version == want and sums(left.path) == sums(wdir(run, want))
    assert any(p.name.startswith(".tmp-") for p in copy.root.iterdir()) == (at == "rename")
    state, read = copy.advance(3, delta_only(run, 3, tmp_path / "delta-3"), read_header(wdir(run, 3))) \
        if want == 2 else copy.advance(2, src, read_header(wdir(run, 2)))
    assert read < full_bytes(wdir(run, state.version)) / 5 and sums(state.path) == sums(wdir(run, state.version))
    assert sorted(p.name for p in copy.root.iterdir()) == [f"v{state.version:06d}"]


def test_the_routes_of_engines_that_cannot_apply_a_delta(run):
    """SGLang's capabilities: the local copy for engines on this host, full weights for the others and when
    sync.local_copy is off; the embedded engine's stay the delta's."""
    cfg = run.config()
    header = read_header(wdir(run, 2))
    here, there = "http://127.0.0.1:1", "http://192.0.2.7:30000"  # TEST-NET-1: never this host
    assert on_this_host(here) and on_this_host("http://localhost:5") and not on_this_host(there)
    routes = asyncio.run(DeltaWeights(cfg.sync, SGLANG_CPU)._routes({here: None, there: None}, header))
    assert routes == {here: "local_copy", there: "full"}
    off = cfg.sync.model_copy(update={"local_copy": False})
    assert asyncio.run(DeltaWeights(off, SGLANG_CPU)._routes({here: None}, header)) == {here: "full"}
    assert asyncio.run(DeltaWeights(cfg.sync, SGLANG_CPU)._routes({here: None}, None)) == {here: "full"}
    assert DeltaWeights(cfg.sync, EMBEDDED).caps.deltas and not EMBEDDED.local_copy


def test_the_copy_directory_is_absolute_and_defaults_to_the_hosts_temporary_directory(tmp_path, monkeypatch):
    from slimectl.contract.config import load_config
    from slimectl.contract.errors import ConfigError
    from slimectl.weight_formats.local_copy import default_root

    with pytest.raises(ConfigError, match="sync.local_copy_dir .*'copies' is relative; give an absolute path"):
        load_config(None, ["sync.local_copy_dir=copies"])
    monkeypatch.setenv("HOME", str(tmp_path))
    form = DeltaWeights(load_config(None, ["sync.mode=delta", "sync.local_copy_dir=~/c"]).sync, SGLANG_CPU)
    source = form.source_from_dir(1, tmp_path / "runs" / "r1" / "weights" / "000001")
    assert form.local_copy_of(source).root.parent == tmp_path / "c"
    assert form.local_copy_of(source).root.name.startswith("r1-")
    other = form.source_from_dir(1, tmp_path / "elsewhere" / "r1" / "weights" / "000001")
    assert form.local_copy_of(other).root != form.local_copy_of(source).root  # one directory per run
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert default_root() == tmp_path / "tmp" / f"slimectl-weight-copies-{getpass.getuser()}"


def test_an_engine_that_loads_from_disk_gets_each_delta_through_the_local_copy(run):
    """The format's disk push with SGLang's capabilities, to our embedded engine (the same
    /update_weights_from_disk): versions 1-5, weights/2-5's safetensors zeroed while they are pushed (only their
    delta may be read), and the engine holds weights/N bit for bit each time, from the run's copy."""
    from slimectl.engines.client import EngineClient

    form = DeltaWeights(run.config().sync, SGLANG_CPU)
    proc, url = start_engine(run.config().model.path, run.path / "engine.log")

    async def push(v: int) -> int:
        async with EngineClient(url) as c:
            return await form.push_disk({url: c}, form.source_from_dir(v, wdir(run, v)))

    try:
        assert asyncio.run(push(1)) > full_bytes(wdir(run, 1))  # no copy yet: weights/1 copied in full
        assert_engine_holds(run, url, 1)
        for v in range(2, 6):
            with safetensors_zeroed(wdir(run, v)):
                moved = asyncio.run(push(v))
            assert moved == read_header(wdir(run, v))["blob_bytes"] + (wdir(run, v) / DELTA_META).stat().st_size
            assert_engine_holds(run, url, v)
        copies = form.local_copy_of(form.source_from_dir(5, wdir(run, 5))).root
        assert copies.parent == Path(run.config().sync.local_copy_dir)
        assert sorted(p.name for p in copies.iterdir()) == ["v000005"]
    finally:
        proc.kill()
        proc.wait()
