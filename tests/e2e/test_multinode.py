"""Multi-host stages without Ray, simulated on one machine: the examples/multinode recipe.

Each "host" is its own process tree (``start_new_session``) with its own host identity
(``SLIMECTL_HOST_ID``, what locks, artifact writers and the engine registry compare before
trusting a pid), and the serve host binds its own loopback address (127.0.0.2), so URLs and the
weight-update rendezvous cross "hosts" as they would across machines. They share nothing but
the run directory. The role scripts under examples/multinode/ run as they are.

Every `slimectl` and `wait_for.py` a script starts (through common.sh's ``SLIMECTL`` and
``PYTHON``) is forked from one fork server for the module (tests/forkserver.py), which paid
the imports once: ~40 interpreters per test otherwise. Each forked command is still a process of
its own (its own session, pid recorded for its host), and a host's kill -9 sends SIGKILL to the
script's process group and to every process forked for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from slimectl.contract.rundir import RunDir
from tests.forkserver import ForkServer
from tests.helpers import ARITH, ROOT, free_port, read_jsonl, slimectl_in_process

RECIPE = ROOT / "examples" / "multinode"
SERVE_ADDR = "127.0.0.2"  # the serve "host"; train and sync live on 127.0.0.1
TOKEN = "multinode-test-token"


@pytest.fixture(scope="module")
def forks(stage_forks):
    """The worker's fork server for commands (tests/conftest.py's ``stage_forks``; tests/forkserver.py): each
    command a process of its own, its imports paid once."""
    return stage_forks


def init_run(tmp_path: Path, num_rollout: int, *sets: str) -> RunDir:
    cfg = {"name": "multinode", "data": {"prompt_data": str(ARITH)},
           "rollout": {"num_rollout": num_rollout, "batch_size": 2, "n_samples_per_prompt": 4, "max_response_len": 6,
                       "reward": "random"},
           "train": {"lr": 1e-3, "keep_checkpoints": 10},
           "sync": {"transport": "distributed", "master_addr": "127.0.0.1"},
           "logging": {"tensorboard": False}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = slimectl_in_process("init", tmp_path / "run", "-c", path, "--tiny-model", "qwen2",
                              *[x for s in sets for x in ("--set", s)])  # in-process: no interpreter start to pay
    assert res.returncode == 0, res.stderr[-2000:]
    return RunDir.open(tmp_path / "run")


class Host:
    """One simulated machine running one role script of the recipe, in its own session."""

    def __init__(self, forks: ForkServer, run: RunDir, name: str, host_id: str, script: str, *args: str, **env: str):
        self.run, self.name, self.host_id, self.script, self.args = run, name, host_id, script, args
        self.forks = forks
        self.pids_file = run.path.parent / f"{name}.pids"  # the processes forked for this host (their own groups)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "SLIMECTL_RUN_DIR": str(run.path),
                    "SLIMECTL_HOST_ID": host_id, "SLIMECTL_ENGINE_TOKEN": TOKEN, "WAIT_TIMEOUT": "150",
                    **forks.env(self.pids_file), **env}
        self.starts = 0
        self.proc: subprocess.Popen | None = None

    @property
    def log(self) -> Path:
        return self.run.path.parent / f"{self.name}-{self.starts}.log"

    def start(self) -> "Host":
        self.starts += 1
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(["bash", str(RECIPE / self.script), *self.args], stdout=out,
                                         stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        return self

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def groups(self) -> list[int]:
        """The machine's process groups: the script's, and each forked `slimectl`/`wait_for.py`'s."""
        return [self.proc.pid, *self.forks.children(self.pids_file)]

    def signal(self, sig: int) -> None:
        for group in self.groups():  # the whole machine: the script and every process it started
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """kill -9 everything on the machine, and return once all of it is gone (not merely signalled)."""
        import psutil

        procs = self.members()  # before the kill: an orphan leaves the tree (an engine leads a session of its own)
        deadline = time.monotonic() + 30
        while True:
            self.signal(signal.SIGKILL)
            for p in procs:
                try:
                    p.kill()  # psutil checks it is still the same process
                except psutil.NoSuchProcess:
                    pass
            if self.proc.poll() is None:
                self.proc.wait(timeout=30)
            procs = [p for p in procs if _running(p)] + self.members()  # and any process forked for it meanwhile
            if not procs:
                return
            assert time.monotonic() < deadline, f"{self.name}: processes survived kill -9: {[p.pid for p in procs]}"
            time.sleep(0.05)

    def members(self) -> list:
        """The machine's live processes: the script's process group, each forked command's, and all
        their descendants (`serve` starts each engine in a session of its own)."""
        import psutil

        groups, found = set(self.groups()), {}
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) in groups:
                    found[p.pid] = p
                    found.update((c.pid, c) for c in p.children(recursive=True))
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
        return [p for p in found.values() if _running(p)]

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not finish in {timeout:.0f} s:\n{self.text()[-3000:]}") from None

    def ensure_gone(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_until(cond, timeout: float, what: str, hosts=()) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for h in hosts:
            if h.proc.poll() not in (None, 0):
                raise AssertionError(f"{h.name} failed (exit {h.proc.returncode}) while waiting for {what}:\n"
                                     f"{h.text()[-3000:]}")
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {h.name}\n{h.text()[-1500:]}" for h in hosts)
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.02)


def assert_every_rollout_trained_once(run: RunDir, n: int) -> None:
    cur = run.cursor("train").read()
    assert cur.next == n and cur.consumed == list(range(n))  # exactly once, in order
    assert run.rollouts.ids() == list(range(n))
    last = run.checkpoints.get(run.checkpoints.ids()[-1])
    assert last.meta["next_rollout"] == n and last.meta["actor_step"] == n  # one step per rollout, none twice
    for kind in ("rollouts", "checkpoints", "weights"):  # no torn artifact anywhere: sizes and sha256 match
        store = run.artifacts(kind)
        for i in store.ids():
            store.get(i, verify="full")


def assert_engines_serve(run: RunDir, version: int) -> None:
    """Checked while the serve host still runs: its records carry its own address and the final version."""
    recs = run.engines.list()
    assert recs and all(r.url.startswith(f"http://{SERVE_ADDR}:") and r.host_id == "serve-host" for r in recs)
    assert {r.weight_version for r in recs} == {str(version)}


@pytest.mark.slow
@pytest.mark.xdist_group("multinode")  # xdist: one worker, one fork server for both
def test_three_hosts_one_step_off_survive_kill_9_of_the_rollout_and_train_hosts(tmp_path, monkeypatch, forks):
    """serve (127.0.0.2) / rollout / train + sync driver on three "hosts", one-step-off (rollout N
    on version N-1, overlapping training on N-1), NCCL-style distributed sync (gloo here). The
    rollout host is killed -9 holding the rollout lock, and the train host in the middle of a
    step; both restart and the run finishes with every rollout trained exactly once (three
    rollouts: one for each kill to land in, one after both)."""
    run = init_run(tmp_path, 3)
    lag = {"ROLLOUT_LAG": "1"}
    serve = Host(forks, run, "serve", "serve-host", "serve_host.sh", SERVE_BIND=SERVE_ADDR)
    rollout = Host(forks, run, "rollout", "rollout-host", "rollout_host.sh", **lag)
    train = Host(forks, run, "train", "train-host", "train_host.sh")
    sync = Host(forks, run, "sync", "train-host", "sync_loop.sh", **lag)
    hosts = [serve, rollout, train, sync]
    try:
        for h in hosts:
            h.start()

        # 1. kill -9 the rollout host while it generates rollout 1 (it holds locks/rollout.lock).
        lock_file = run.path / "locks" / "rollout.lock"
        wait_until(lambda: "rollout 1: generating" in rollout.text() and lock_file.exists(), 120, "rollout 1 to start",
                   hosts)
        rollout.kill()
        assert not run.rollouts.exists(1)
        held = json.loads(lock_file.read_text())
        assert held["host_id"] == "rollout-host"
        monkeypatch.setenv("SLIMECTL_HOST_ID", "train-host")
        assert run.lock("rollout").holder()["stale"] is False  # a pid of another host proves nothing here
        monkeypatch.setenv("SLIMECTL_HOST_ID", "rollout-host")
        assert run.lock("rollout").holder()["stale"] is True  # its own host sees the pid is gone
        monkeypatch.delenv("SLIMECTL_HOST_ID")
        rollout.start()
        wait_until(lambda: run.rollouts.exists(1), 60, "the restarted rollout host to publish rollout 1", hosts)
        assert "taking over stale rollout lock" in rollout.text()  # at once, not after a heartbeat timeout

        # 2. kill -9 the train host (trainer and sync driver) right after a training step, before
        #    its checkpoint and cursor commit are known to be done.
        wait_until(lambda: "step 2 (rollout 1)" in train.text(), 120, "train step 2", hosts)
        train.kill()
        sync.kill()
        train.start()
        sync.start()

        for h in (rollout, train, sync):
            assert h.wait(150) == 0, f"{h.name}:\n{h.text()[-3000:]}"
        assert "resuming at rollout" in train.text()
        assert_engines_serve(run, 3)
    finally:
        for h in hosts:
            h.ensure_gone()
    assert serve.proc.returncode in (0, -signal.SIGTERM), serve.text()[-2000:]
    assert_every_rollout_trained_once(run, 3)
    versions = [run.rollouts.get(i).meta["weight_version"] for i in range(3)]
    assert versions == ["0", "0", "1"]  # one step off: never an update in the middle of a rollout
    # The driver pushes the newest version the engines may take, so it can skip one (2, when train
    # published 2 and 3 while the driver was down), and a sync killed with the train host after
    # recording the engines' new version leaves no metrics line; never does a version go back.
    synced = [r["step"] for r in read_jsonl(run.metrics_path("sync"))]
    assert synced == sorted(synced) and set(synced) <= {1, 2, 3} and synced[-1] == 3, synced
    # bench/gpu_check.sh's summary reads runs of the stages run apart as well as `slimectl rl` runs
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_summary.py"), str(run.path)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    figures = {k.strip(): v for k, v in (line.split(" : ", 1) for line in res.stdout.splitlines() if " : " in line)}
    assert float(figures["rollout tokens/s"].replace(",", "")) > 0
    assert figures["sync seconds"].split()[1] == "s" and figures["logprob |train-rollout|"].startswith("mean ")


# ---------------------------------------------------------------------------------------------
# Host identity: a pid is only checked on the host (process table) that recorded it.
# ---------------------------------------------------------------------------------------------

def write_lock(locks_dir: Path, **record) -> Path:
    locks_dir.mkdir(parents=True, exist_ok=True)
    path = locks_dir / "train.lock"
    path.write_text(json.dumps({"stage": "train", "token": "theirs", "acquired": "earlier", **record}))
    return path


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped (a fork that exits at once: no interpreter to start)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


@pytest.mark.xdist_group("multinode")
def test_the_fork_server_outlives_clients_killed_around_their_hand_over(tmp_path, forks):
    """A host's kill -9 can land on a forkclient at any moment of its hand-over; its socket is then
    reset, not closed (what took the server down in CI, and both multinode tests with it). The
    server kills that client's child and goes on serving: here one client resets after its pid came,
    one right after sending its job, and a third command still runs."""
    import socket
    import struct

    import psutil

    def hand_over(read_pid: bool) -> int | None:
        sleeper = tmp_path / "sleep.py"
        sleeper.write_text("import time\ntime.sleep(120)\n")
        job = {"mode": "python", "argv": [str(sleeper)], "env": dict(os.environ), "cwd": str(tmp_path)}
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(forks.socket))
        with open(os.devnull, "rb") as null:
            socket.send_fds(sock, [json.dumps(job).encode() + b"\n"], [null.fileno()] * 3)
        pid = json.loads(sock.makefile("rb").readline())["pid"] if read_pid else None
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
        sock.close()
        return pid

    pid = hand_over(read_pid=True)
    hand_over(read_pid=False)
    try:
        psutil.Process(pid).wait(30)  # killed with its client (reaped by the server)
    except psutil.NoSuchProcess:
        pass
    res = forks.slimectl("--version", out_dir=tmp_path)
    assert res.returncode == 0 and res.stdout.strip(), res.stderr
    assert forks.proc.poll() is None


def test_lock_of_a_dead_pid_is_stale_only_on_its_own_host(tmp_path, monkeypatch):
    from slimectl.contract.errors import LockHeld
    from slimectl.contract.rundir.atomic import hostname
    from slimectl.contract.rundir.locks import StageLock

    # Same hostname (containers often share one) but another host id: the pid means nothing here.
    write_lock(tmp_path, host=hostname(), host_id="node-b", pid=dead_pid())
    monkeypatch.setenv("SLIMECTL_HOST_ID", "node-a")
    lock = StageLock(tmp_path, "train", stale_after=30)
    assert lock.holder()["stale"] is False
    with pytest.raises(LockHeld, match="already running"):
        lock.acquire()
    monkeypatch.setenv("SLIMECTL_HOST_ID", "node-b")  # its own host sees the holder is gone: taken over at once
    t0 = time.monotonic()
    lock.acquire()
    assert time.monotonic() - t0 < 2
    mine = json.loads((tmp_path / "train.lock").read_text())
    assert mine["host_id"] == "node-b" and mine["pid"] == os.getpid()
    lock.release()


def test_lock_records_without_host_id_are_judged_by_hostname(tmp_path):
    """Locks written before host_id existed keep their old meaning."""
    from slimectl.contract.rundir.atomic import hostname
    from slimectl.contract.rundir.locks import StageLock

    write_lock(tmp_path, host=hostname(), pid=dead_pid())
    assert StageLock(tmp_path, "train").holder()["stale"] is True
    write_lock(tmp_path, host="elsewhere", pid=dead_pid())
    assert StageLock(tmp_path, "train", stale_after=30).holder()["stale"] is False


def test_default_host_id_tells_the_process_table_apart():
    from slimectl.contract.rundir.atomic import host_id, hostname

    ident = host_id()
    assert ident.startswith(hostname())
    if Path("/proc/self/ns/pid").exists():
        assert ident.endswith("/" + str(os.stat("/proc/self/ns/pid").st_ino))
    env = {**os.environ, "SLIMECTL_HOST_ID": "rack7-node3"}
    out = subprocess.run([sys.executable, "-c", "from slimectl.contract.rundir.atomic import host_id; print(host_id())"],
                         capture_output=True, text=True, env=env, timeout=60).stdout.strip()
    assert out == "rack7-node3"


def test_engine_and_writer_records_of_another_host_are_never_judged_dead(tmp_path, monkeypatch):
    from slimectl.contract.rundir import EngineRecord, EngineRegistry
    from slimectl.contract.rundir.artifacts import writer_alive

    monkeypatch.setenv("SLIMECTL_HOST_ID", "serve-host")
    reg = EngineRegistry(tmp_path / "engines")
    rec = reg.register(EngineRecord(url="http://127.0.0.2:30000", backend="embedded", pid=dead_pid(), id="e0"))
    assert rec.host_id == "serve-host" and reg.get("e0").alive() is False
    monkeypatch.setenv("SLIMECTL_HOST_ID", "rollout-host")
    assert reg.get("e0").alive() is None and [r.id for r in reg.live()] == ["e0"]
    assert reg.prune_dead() == [] and reg.get("e0")  # only its own host may prune it
    legacy = json.loads((tmp_path / "engines" / "e0.json").read_text())
    del legacy["host_id"]
    (tmp_path / "engines" / "e0.json").write_text(json.dumps(legacy))
    assert reg.get("e0").host_id is None  # an old record is not adopted by whoever reads it

    staging = tmp_path / "staging"
    staging.mkdir()
    info = {"host": "vm", "host_id": "train-host", "pid": dead_pid()}
    assert writer_alive(info, staging, stale_after=3600) is True  # fresh files, writer on another host
    monkeypatch.setenv("SLIMECTL_HOST_ID", "train-host")
    assert writer_alive(info, staging, stale_after=3600) is False


# ---------------------------------------------------------------------------------------------
# Addresses other hosts can use.
# ---------------------------------------------------------------------------------------------

def test_engines_bound_to_a_wildcard_are_recorded_with_a_reachable_address():
    from slimectl.stages.serve import advertised_host

    assert advertised_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"  # engine.advertise_host wins
    assert advertised_host("127.0.0.2") == "127.0.0.2"  # a specific address is itself
    addr = advertised_host("0.0.0.0")
    assert addr not in ("0.0.0.0", "", "::")
    import socket

    with socket.socket() as s:  # it is one of this machine's addresses (binding succeeds only then)
        s.bind((addr, 0))


def test_serve_dry_run_takes_the_advertised_address(tmp_path, cli):
    res = cli("init", tmp_path / "run", "--tiny-model", "qwen2")
    assert res.exit_code == 0, res.output
    res = cli("serve", "-r", tmp_path / "run", "--host", "0.0.0.0", "--advertise-host", "node7.cluster", "--dry-run")
    assert res.exit_code == 0, res.output
    engine = yaml.safe_load(res.output)["engine"]
    assert engine["host"] == "0.0.0.0" and engine["advertise_host"] == "node7.cluster"


def test_weight_update_rendezvous_refuses_addresses_the_engines_cannot_reach():
    from slimectl.contract.errors import UsageError
    from slimectl.stages.sync.distributed import check_master_addr

    with pytest.raises(UsageError, match="wildcard"):
        check_master_addr("0.0.0.0", 0, ["http://127.0.0.1:30000"])
    with pytest.raises(UsageError, match="engine http://203.0.113.77:30000 is on another host"):
        check_master_addr("127.0.0.1", 0, ["http://127.0.0.2:30000", "http://203.0.113.77:30000"])
    with pytest.raises(UsageError, match="not an address of this host"):
        check_master_addr("203.0.113.77", 0, ["http://203.0.113.78:30000"])
    check_master_addr("127.0.0.1", 0, ["http://127.0.0.2:30000", "http://localhost:30001"])  # all on this machine
    check_master_addr("203.0.113.77", 29600, ["http://203.0.113.78:30000"])  # a fixed port: NAT setups are allowed


def test_train_across_nodes_checks_its_options_before_launching(tmp_path, cli):
    res = cli("init", tmp_path / "run", "--tiny-model", "qwen2", "--set", "train.dp=2")
    assert res.exit_code == 0, res.output
    run = str(tmp_path / "run")
    res = cli("train", "-r", run, "--nnodes", "2")
    assert res.exit_code != 0 and "--master-addr" in res.output and "--master-port" in res.output
    res = cli("train", "-r", run, "--nnodes", "3", "--master-addr", "127.0.0.1", "--master-port", "29500")
    assert res.exit_code != 0 and "--nnodes 3 must divide train.tp*pp*dp = 2" in res.output
    res = cli("train", "-r", run, "--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1",
              "--master-port", "29500")
    assert res.exit_code != 0 and "--node-rank 2 must be in 0..1" in res.output


def test_gpu_summary_says_when_a_run_has_no_training_steps(tmp_path):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "rollout.jsonl").write_text('{"step": 0, "perf/rollout_tokens_per_s": "nan"}\n{"step": 1, "perf/ro')
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_summary.py"), str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 1 and "no training steps" in res.stderr
    assert "rollout tokens/s        : n/a" in res.stdout  # NaN and the torn last line are skipped


@pytest.mark.slow
@pytest.mark.xdist_group("multinode")  # xdist: one worker, one fork server for both
def test_two_train_nodes_under_torchrun_and_the_serve_host_killed_mid_rollout(tmp_path, forks):
    """train.dp=2 spread over two train "hosts" (--nnodes 2, one rank each, torchrun's static
    rendezvous on node 0), on-policy: the run trains each rollout once and node 1 never writes.

    Meanwhile the serve host is killed -9 (its engines die with it) while rollout 1 is being
    generated: the rollout host stops with a one-line error naming the dead engine and publishes
    nothing; the restarted serve host drops its dead records and serves the initial weights again;
    the sync loop brings the engines back to the trained version; the run finishes, each rollout
    trained once, no rollout generated across a weight change. (One run for both: the train nodes
    and the serve host never meet but in the run directory; two rollouts, the second is the one killed.)"""
    run = init_run(tmp_path, 2, "train.dp=2", "rollout.max_response_len=48")
    port = free_port()
    nodes = {"NNODES": "2", "TRAIN_MASTER_ADDR": "127.0.0.1", "TRAIN_MASTER_PORT": str(port)}
    serve = Host(forks, run, "serve", "serve-host", "serve_host.sh", SERVE_BIND=SERVE_ADDR)
    rollout = Host(forks, run, "rollout", "rollout-host", "rollout_host.sh")
    train0 = Host(forks, run, "train0", "train-node-0", "train_host.sh", NODE_RANK="0", **nodes)
    train1 = Host(forks, run, "train1", "train-node-1", "train_host.sh", NODE_RANK="1", **nodes)
    sync = Host(forks, run, "sync", "train-node-0", "sync_loop.sh")
    hosts = [serve, rollout, train0, train1, sync]
    try:
        for h in hosts:
            h.start()
        lock_file = run.path / "locks" / "rollout.lock"
        # the rollout host says "generating" once the engines serve version 1, then takes the lock
        wait_until(lambda: "rollout 1: generating" in rollout.text() and lock_file.exists(), 200, "rollout 1 to start",
                   hosts)
        dead = {r.id for r in run.engines.list()}
        serve.kill()
        mid_rollout = not run.rollouts.exists(1)
        if mid_rollout:
            rc = rollout.wait(120)
            assert rc != 0
            errors = [x for x in rollout.text().splitlines() if x.startswith("Error:")]
            assert len(errors) == 1 and "engine" in errors[0], rollout.text()[-3000:]
            assert not run.rollouts.exists(1) and run.rollouts.ids() == [0]  # nothing half-written published
        serve.start()
        wait_until(lambda: run.engines.list() and not dead & {r.id for r in run.engines.list()}, 120,
                   "the restarted serve host to replace its dead engine records", [serve])
        for h in (rollout, sync):  # a host whose stage failed on the dead engines is restarted
            if h.proc.poll() is not None and h.proc.returncode != 0:
                h.start()
        for h in (rollout, train0, train1, sync):
            assert h.wait(240) == 0, f"{h.name}:\n{h.text()[-3000:]}"
        assert_engines_serve(run, 2)
    finally:
        for h in hosts:
            h.ensure_gone()
    assert "trained rollouts 0-1; weight version 2" in train0.text()
    assert "trained rollouts" not in train1.text()  # rank 1 (node 1) prints nothing and writes nothing
    assert_every_rollout_trained_once(run, 2)
    assert [run.rollouts.get(i).meta["weight_version"] for i in range(2)] == ["0", "1"]  # on-policy
