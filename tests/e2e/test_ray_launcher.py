"""slimectl rl --launcher ray on a real two-node Ray cluster (Ray's own ``cluster_utils.Cluster``,
both nodes on this machine): engines and trainer in separate Ray actors, colocated and
disaggregated placement, the same run directory as a local run, resume after kill -9 of the driver.
The drivers are processes of their own, forked by one fork server for the module (tests/forkserver.py)
so that their imports are paid once."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import psutil
import pytest

from slimectl.contract.errors import UsageError
from slimectl.orchestration.ray_launcher import Slot, placement_layout
from slimectl.contract.metrics import read_metrics
from slimectl.contract.rundir import RunDir
from tests.forkserver import ForkServer
from tests.helpers import assert_trained_once, read_jsonl, slimectl_in_process, write_config

pytestmark = pytest.mark.xdist_group("ray")  # under pytest-xdist, one worker runs the module: one Ray cluster


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of one logical CPU each: a bundle of {"CPU": 1} fills a node, so the
    disaggregated trainer and engine bundles must land on different nodes."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        c.add_node(num_cpus=1)
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def forks(stage_forks):
    """The worker's fork server for commands (tests/conftest.py's ``stage_forks``; tests/forkserver.py): each
    command a process of its own, its imports paid once."""
    return stage_forks


class Driver:
    """`slimectl rl` as a process of its own (forked by the fork server) whose stderr is read line by line."""

    def __init__(self, forks: ForkServer, tmp_path, *args):
        n = forks.count
        self.proc = forks.run(["rl", *map(str, args)], tmp_path / f"driver-{n}.out", tmp_path / f"driver-{n}.err")
        self.lines: list[str] = []
        self._err = None
        self._tail = ""

    def _read(self) -> list[str]:
        """The stderr lines written since the last call (a partial last line waits for its end)."""
        if self._err is None:
            self._err = open(self.proc.stderr, errors="replace")
        *new, self._tail = (self._tail + self._err.read()).split("\n")
        return [line + "\n" for line in new]

    def wait_for(self, marker: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ended = self.proc.poll() is not None
            for line in self._read():
                self.lines.append(line)
                if marker in line:
                    return
            if ended:
                break
            time.sleep(0.05)
        self.proc.kill()
        self.proc.wait(30)
        raise AssertionError(f"no {marker!r} from the driver:\n" + "".join(self.lines)[-4000:])

    def finish(self, timeout: float = 180) -> tuple[int, str, str]:
        rc = self.proc.wait(timeout=timeout)
        self.lines += self._read()
        if self._tail:
            self.lines.append(self._tail)
        self._err.close()
        return rc, self.proc.stdout.read_text(), "".join(self.lines)


def placement(run: RunDir, driver_pid: int) -> dict:
    """Which processes hold the trainer and the engine right now, checked against Ray's process titles."""
    lock = json.loads((run.path / "locks" / "train.lock").read_text())
    (rec,) = run.engines.list()
    trainer, engine_actor = psutil.Process(lock["pid"]), psutil.Process(rec.extra["actor_pid"])
    assert trainer.pid != driver_pid and engine_actor.pid not in (driver_pid, trainer.pid)
    assert "ray::TrainerWorker" in " ".join(trainer.cmdline())  # a Ray worker running the trainer actor
    assert "ray::EngineWorker" in " ".join(engine_actor.cmdline())
    assert psutil.Process(rec.pid).ppid() == engine_actor.pid  # the engine is the actor's child process
    assert rec.extra["launcher"] == "ray" and rec.id == f"engine-0-{engine_actor.pid}"
    # a Ray worker is a child of its node's raylet: same parent = same Ray node
    return {"trainer": trainer.pid, "engine_actor": engine_actor.pid, "engine": rec.pid,
            "same_node": trainer.ppid() == engine_actor.ppid()}


def wait_gone(pids, timeout=30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if psutil.pid_exists(p)]


@pytest.mark.slow
def test_rl_on_a_ray_cluster_places_actors_and_resumes_after_the_driver_is_killed(tmp_path, cluster, clean_rl_run,
                                                                                  forks):
    cfg = write_config(tmp_path, rollout={"num_rollout": 2})
    path = tmp_path / "run"
    ray_args = ("--launcher", "ray", "--address", cluster.address)

    # 1. colocated: trainer and engine share one bundle (one node); kill -9 the driver after rollout 0
    first = Driver(forks, tmp_path, "-c", cfg, "-r", path, "--tiny-model", "qwen2", *ray_args, "--colocate")
    first.wait_for("resuming at rollout 0")
    run = RunDir.open(path)
    where = placement(run, first.proc.pid)
    assert where["same_node"], where
    first.wait_for("rl 1/2")
    first.proc.kill()
    assert first.proc.wait() == -signal.SIGKILL
    # Ray ends a dead driver's actors; the engine follows its actor
    assert wait_gone([where["trainer"], where["engine_actor"], where["engine"]]) == []
    # Checkpoints are written in the background and the cursor commits after them: killed right after
    # "rl 1/2", rollout 0 is committed, or not yet (then the rerun trains it again, once)
    done = run.cursor("train").read().consumed
    assert done in ([], [0]), done
    # killed after checkpoints/1 was sealed but before the cursor committed rollout 0: the checkpoint holds
    # rollout 0's training, so the rerun counts it consumed (exactly once) and resumes at 1
    resume_at = max(len(done), max(run.checkpoints.ids(), default=0))
    assert resume_at in (0, 1), (done, run.checkpoints.ids())

    # 2. rerun, disaggregated: separate bundles, which on these one-CPU nodes means separate nodes
    second = Driver(forks, tmp_path, "-c", cfg, "-r", path, *ray_args)
    second.wait_for(f"resuming at rollout {resume_at}")
    where2 = placement(run, second.proc.pid)
    assert not where2["same_node"], where2
    rc, out, err = second.finish()
    assert rc == 0, err[-4000:]
    assert ("trained rollouts 1; weight version 2" if resume_at else "trained rollouts 0-1; weight version 2") in out
    assert_trained_once(run, 2)
    assert run.engines.list() == [] and not list((run.path / "locks").glob("*.lock"))
    assert wait_gone([where2["trainer"], where2["engine_actor"], where2["engine"]]) == []

    # 3. the same run directory as the local launcher makes from the same config
    local, local_cfg = clean_rl_run  # `rl` on the local launcher (made once, shared read-only)
    assert local_cfg.read_text() == cfg.read_text()
    for kind in ("rollouts", "checkpoints", "weights"):
        assert getattr(run, kind).ids() == getattr(local, kind).ids(), kind
    for stage in ("rollout", "train", "sync", "rl"):
        # each step's last record (read_metrics drops rolled-back train steps): a resumed run syncs the
        # version it resumes at once more, and logs a rollout it trains again twice
        ray_recs = {r["step"]: r for r in read_metrics(run.metrics_path(stage))}
        local_recs = {r["step"]: r for r in read_metrics(local.metrics_path(stage))}
        assert sorted(ray_recs) == sorted(local_recs), stage
        assert {k: set(r) for k, r in ray_recs.items()} == {k: set(r) for k, r in local_recs.items()}, stage
    # the same stage code on the same seeds and weights: the same samples, the same rewards
    assert [run.rollouts.get(i).meta["reward_mean"] for i in (0, 1)] == \
           [local.rollouts.get(i).meta["reward_mean"] for i in (0, 1)]


@pytest.mark.slow
def test_sigterm_stops_the_actors_cleanly(tmp_path, cluster, forks):
    """ray.init replaces the driver's signal handlers; rl's own must still stop every actor cleanly."""
    cfg = write_config(tmp_path, rollout={"num_rollout": 2})
    driver = Driver(forks, tmp_path, "-c", cfg, "-r", tmp_path / "run", "--tiny-model", "qwen2", "--launcher", "ray",
                    "--address", cluster.address)
    driver.wait_for("resuming at rollout 0")
    run = RunDir.open(tmp_path / "run")
    where = placement(run, driver.proc.pid)
    driver.proc.send_signal(signal.SIGTERM)
    rc, _, err = driver.finish(timeout=120)
    assert rc == 143 and "interrupted; resume with: slimectl rl -c" in err, err[-3000:]  # 128 + SIGTERM
    assert run.engines.list() == [] and not list((run.path / "locks").glob("*.lock"))  # unregistered, released
    assert wait_gone([where["trainer"], where["engine_actor"], where["engine"]]) == []


@pytest.mark.slow
def test_rl_fully_async_on_ray_trains_each_rollout_once(tmp_path, cluster, forks):
    """rollout.async_mode = fully_async under the Ray launcher: the driver's follower thread generates on the
    engine actor while the trainer actor trains; every rollout is trained once, each prompt group in one rollout."""
    from tests.e2e.test_fully_async import audit_fully_async

    cfg = write_config(tmp_path, rollout={"num_rollout": 4, "async_mode": "fully_async"})
    driver = Driver(forks, tmp_path, "-c", cfg, "-r", tmp_path / "run", "--tiny-model", "qwen2", "--launcher", "ray",
                    "--address", cluster.address)
    rc, out, err = driver.finish(timeout=300)
    assert rc == 0, err[-4000:]
    assert "trained rollouts 0-3; weight version 4" in out and "fully async loop" in err
    run = RunDir.open(tmp_path / "run")
    audit_fully_async(run, 4, 2)
    assert run.engines.list() == []
    # the trace's waits agree with the loop's metrics: the trainer's wait for each rollout
    from slimectl.contract.trace import read_traces, wait_seconds

    (train,) = [f for f in read_traces(run) if f.path.stem == "train"]
    traced = wait_seconds(train.spans)["wait:rollout"]
    measured = sum(r["perf/rl_rollout_wait_time"] for r in read_jsonl(run.metrics_path("rl")))
    assert abs(traced - measured) <= 0.05 * 4 + 0.05 * measured, (traced, measured)
    (rollout,) = [f for f in read_traces(run) if f.path.stem == "rollout"]
    assert {s.name for s in rollout.spans} >= {"rollout", "generate", "reward", "publish"}


def test_an_error_inside_an_actor_is_one_line(tmp_path, cluster, forks):
    """The trainer actor cannot take the train lock held here: the driver says so in one line."""
    cfg = write_config(tmp_path, rollout={"num_rollout": 1})
    assert slimectl_in_process("init", tmp_path / "run", "-c", cfg, "--tiny-model", "qwen2").returncode == 0
    run = RunDir.open(tmp_path / "run")
    with run.lock("train"):
        res = forks.slimectl("rl", "-r", run.path, "--launcher", "ray", "--address", cluster.address, out_dir=tmp_path)
    assert res.returncode == 1, res.stderr[-3000:]
    (line,) = [x for x in res.stderr.splitlines() if x.startswith("Error:")]
    assert f"stage 'train' is already running in this run directory: pid {os.getpid()}" in line
    assert "Traceback" not in res.stderr
    assert run.engines.list() == [] and not list((run.path / "locks").glob("*.lock"))


def test_ray_options_need_the_ray_launcher_and_ray_itself(tmp_path, monkeypatch):
    res = slimectl_in_process("rl", "-r", tmp_path, "--address", "auto")
    assert res.returncode == 2 and "--address places actors on Ray; add --launcher ray" in res.stderr
    # `import ray` fails, as on an install without the extra (None in sys.modules: ImportError)
    monkeypatch.setitem(sys.modules, "ray", None)
    res = slimectl_in_process("rl", "-r", tmp_path, "--launcher", "ray")
    assert res.returncode == 2
    assert "--launcher ray needs Ray, which is not installed; pip install 'slimectl[ray]'" in res.stderr


def test_placement_layout_colocated_shares_bundles_disaggregated_separates_them():
    dis = placement_layout(num_engines=2, trainer_ranks=1, colocate=False)
    assert dis.groups == {"trainer": [{"CPU": 1.0}], "engines": [{"CPU": 1.0}, {"CPU": 1.0}]}
    assert dis.trainer == [Slot("trainer", 0, 1.0, 0.0)]
    assert dis.engines == [Slot("engines", 0, 1.0, 0.0), Slot("engines", 1, 1.0, 0.0)]
    co = placement_layout(num_engines=2, trainer_ranks=1, colocate=True, trainer_gpus=1, engine_gpus=1)
    assert co.groups == {"shared": [{"CPU": 1.0, "GPU": 1.0}] * 2}
    assert co.trainer == [Slot("shared", 0, 0.5, 0.5)]  # trainer and engine 0 split bundle 0
    assert co.engines == [Slot("shared", 0, 0.5, 0.5), Slot("shared", 1, 0.5, 0.5)]
    gpu = placement_layout(num_engines=1, trainer_ranks=1, colocate=False, trainer_gpus=1, engine_gpus=2)
    assert gpu.groups == {"trainer": [{"CPU": 1.0, "GPU": 1.0}], "engines": [{"CPU": 1.0, "GPU": 2.0}]}
    with pytest.raises(UsageError, match="engine.tp_size = 2"):
        placement_layout(num_engines=1, trainer_ranks=1, colocate=True, trainer_gpus=1, engine_gpus=2)
    # PPO's critic group: bundles of its own, or a third of the shared ones (its ranks' GPUs like the trainer's)
    dis = placement_layout(num_engines=1, trainer_ranks=1, colocate=False, trainer_gpus=1, critic_ranks=2)
    assert dis.groups["critic"] == [{"CPU": 1.0, "GPU": 1.0}] * 2 and dis.trainer == [Slot("trainer", 0, 1.0, 1.0)]
    assert dis.critic == [Slot("critic", 0, 1.0, 1.0), Slot("critic", 1, 1.0, 1.0)]
    co = placement_layout(num_engines=1, trainer_ranks=2, colocate=True, critic_ranks=2)
    assert co.groups == {"shared": [{"CPU": 1.0}] * 2}
    assert co.trainer == co.critic == [Slot("shared", 0, 0.3333, 0.0), Slot("shared", 1, 0.3333, 0.0)]
    assert co.engines == [Slot("shared", 0, 0.3333, 0.0)]
    gpu = placement_layout(num_engines=1, trainer_ranks=1, colocate=True, trainer_gpus=1, engine_gpus=1, critic_ranks=3)
    assert gpu.groups == {"shared": [{"CPU": 1.0, "GPU": 1.0}] * 3}
    assert gpu.critic[2] == Slot("shared", 2, 0.3333, 0.3333)
    assert placement_layout(num_engines=1, trainer_ranks=1, colocate=False).critic == []


@pytest.fixture(scope="module")
def one_rank_reference(tmp_path_factory, clean_rl_run):
    """The one-rank local run a two-rank Ray run is compared with, made once per sync transport for
    the module (tp and pp share the distributed one: the same config, so the same run). The disk one
    is the session's clean_rl_run: the same config but for sync.verify, which only reads the engines'
    weights back."""
    import yaml

    clean, clean_cfg = clean_rl_run
    runs: dict[str, RunDir] = {}

    def get(sections: dict) -> RunDir:
        key = sections["sync"]["transport"]
        if key == "disk" and key not in runs:
            d = tmp_path_factory.mktemp("one-rank-disk")
            want = yaml.safe_load(write_config(d, train={"lr": 1e-3}, **sections).read_text())
            assert want.pop("sync") == {"transport": "disk", "verify": True}  # the default transport
            assert want == yaml.safe_load(clean_cfg.read_text())
            runs[key] = clean
        if key not in runs:
            d = tmp_path_factory.mktemp(f"one-rank-{key}")
            cfg1 = write_config(d, train={"lr": 1e-3}, **sections)  # the same config, one trainer rank
            local = slimectl_in_process("rl", "-c", cfg1, "-r", d / "local", "--tiny-model", "qwen2")
            assert local.returncode == 0, local.stderr[-3000:]
            runs[key] = RunDir.open(d / "local")
        return runs[key]

    return get


CRITIC_RANK = r"ray: critic rank (\d)/2 \(tp 2, pp 1, dp 1\) in actor \S+ \(pid (\d+)\) on node (\S+), at step (\d+)"


@pytest.mark.slow
@pytest.mark.parametrize("split,transport", [("tp", "distributed"), ("pp", "distributed"), ("dp", "disk")])
def test_a_trainer_with_two_ranks_runs_as_two_actors_on_two_nodes(tmp_path, cluster, forks, one_rank_reference,
                                                                  split, transport):
    """train.tp=2, pp=2 or dp=2 under Ray: two trainer actors, one per node (the colocated group's
    two bundles), form one torch.distributed job. Rank 0 holds the lock and writes the run
    directory; rank 1 joins the training, the publishing of weights/N (disk) or the TP gathers /
    pipeline-stage streaming of the distributed weight sync. The numbers match a one-rank local run of the same config (same
    samples, losses within 1e-4).

    dp=2 trains PPO with its critic as its own actor group at another layout (critic.tp=2: two critic
    actors, one per node, their own torch.distributed world; the actor is at tp=1), killed -9 after
    rollout 0 and resumed: the critic and the actor match the one-process run whose critic is on the
    actor's layout (tp=1), before and after the resume."""
    import re

    sections = dict(rollout={"num_rollout": 2}, sync={"transport": transport, "verify": True})
    ppo = split == "dp"
    if ppo:
        sections["algorithm"] = {"advantage_estimator": "ppo"}
    cfg = write_config(tmp_path, train={"lr": 1e-3, split: 2}, **sections, **({"critic": {"tp": 2, "dp": 1}} if ppo else {}))
    args = ("rl", "-c", cfg, "-r", tmp_path / "run", "--tiny-model", "qwen2", "--launcher", "ray",
            "--address", cluster.address, "--colocate")
    if ppo:  # killed -9 after rollout 0 (checkpoints/1 and critic_checkpoints/1 published), then resumed
        first = Driver(forks, tmp_path, *args[1:])
        first.wait_for("rl 1/2")
        critics = re.findall(CRITIC_RANK, "".join(first.lines))
        assert sorted(c[0] for c in critics) == ["0", "1"] and {c[3] for c in critics} == {"0"}, first.lines[-30:]
        assert len({c[2] for c in critics}) == 2  # one critic actor per node
        for c in critics:
            assert "ray::CriticWorker" in " ".join(psutil.Process(int(c[1])).cmdline())
        first.proc.kill()
        assert first.proc.wait() == -signal.SIGKILL
        assert wait_gone([int(c[1]) for c in critics]) == []  # Ray ends a dead driver's critic actors too
        assert RunDir.open(tmp_path / "run").cursor("train").read().consumed == [0]  # committed before "rl 1/2"
    res = forks.slimectl(*args, out_dir=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    ranks = re.findall(r"ray: trainer rank (\d)/2 in actor \S+ \(pid (\d+)\) on node (\S+),", res.stderr)
    assert sorted(r[0] for r in ranks) == ["0", "1"], res.stderr[-3000:]
    assert len({r[1] for r in ranks}) == 2 and len({r[2] for r in ranks}) == 2  # two processes, two nodes
    run = RunDir.open(tmp_path / "run")
    assert_trained_once(run, 2)
    last = run.checkpoints.get(run.checkpoints.ids()[-1])
    saved = json.loads((last.path / "slimectl_checkpoint.json").read_text())["saved_with"]
    assert saved == {"tp": 1, "pp": 1, "dp": 1, split: 2}
    if transport == "disk":
        assert run.weights.ids()[-2:] == [1, 2]  # published by both ranks together, sealed by rank 0
    sync = read_jsonl(run.metrics_path("sync"))
    # verified after every sync (sync.verify); the resumed run syncs the version it resumes at once more
    assert [r["step"] for r in sync] == ([0, 1, 1, 2] if ppo else [0, 1, 2])
    train = read_jsonl(run.metrics_path("train"))
    assert [r["step"] for r in train] == [1, 2]  # one record per step: rank 1 logs nothing

    # PPO: the same rollouts trained by `slimectl train` in one process, its critic on the actor's layout
    ref = trained_in_one_process(tmp_path / "one-process", run, sections) if ppo else one_rank_reference(sections)
    assert [run.rollouts.get(i).meta["reward_mean"] for i in (0, 1)] == \
           [ref.rollouts.get(i).meta["reward_mean"] for i in (0, 1)]
    for got, want in zip(train, read_jsonl(ref.metrics_path("train")), strict=True):
        assert "train/loss" in want
        for key in ("train/loss", "train/pg_loss", "train/entropy_loss"):
            if key in want:
                assert abs(got[key] - want[key]) <= 1e-4, (key, got[key], want[key])
    if ppo:
        check_the_critic_group(run, ref, res.stderr, train)


def trained_in_one_process(d, ray_run: RunDir, sections: dict) -> RunDir:
    """The Ray run's rollouts trained by `slimectl train` in this process (one rank, the critic on the actor's
    tp=1 layout), from the same initial model: cheaper than a local `rl` (no engine, no sync)."""
    import shutil

    d.mkdir()
    cfg = write_config(d, train={"lr": 1e-3}, **sections)
    model = f"model.path={ray_run.path / 'models' / 'tiny-qwen2'}"
    for args in (("init", d / "run", "-c", cfg, "--set", model), ("convert", "-r", d / "run")):
        res = slimectl_in_process(*args)
        assert res.returncode == 0, res.stderr[-3000:]
    for i in ray_run.rollouts.ids():
        shutil.copytree(ray_run.rollouts.get(i).path, d / "run" / "rollouts" / f"{i:06d}")
    res = slimectl_in_process("train", "-r", d / "run")
    assert res.returncode == 0 and "trained rollouts 0-1; weight version 2" in res.stdout, res.stderr[-3000:]
    return RunDir.open(d / "run")


def check_the_critic_group(run: RunDir, ref: RunDir, stderr: str, train: list[dict]) -> None:
    """The resumed run's critic group (two actors at tp=2, resumed at step 1 from critic_checkpoints/1)
    trained as the one-process critic at tp=1 did: the same critic metrics at every step, the same
    actor weights at the end (the actor's advantages come from the critic's values)."""
    import re

    from safetensors.torch import load_file

    critics = re.findall(CRITIC_RANK, stderr)
    assert sorted(c[0] for c in critics) == ["0", "1"] and {c[3] for c in critics} == {"1"}, stderr[-3000:]
    store = run.artifacts("critic_checkpoints")
    assert store.ids() == [1, 2]
    for i in (1, 2):
        meta = store.get(i).meta
        assert meta["critic_saved_with"] == {"tp": 2, "pp": 1, "dp": 1} and meta["critic_step"] == i
    assert ref.artifacts("critic_checkpoints").get(2).meta["critic_saved_with"] == {"tp": 1, "pp": 1, "dp": 1}
    diffs = {}
    for got, want in zip(train, read_jsonl(ref.metrics_path("train")), strict=True):
        for key in ("critic/value_loss", "critic/value_clipfrac", "critic/values_mean", "critic/explained_variance",
                    "critic/returns_mean", "critic/grad_norm", "critic/step", "train/grad_norm"):
            if key in want:
                diffs[key] = max(diffs.get(key, 0.0), abs(got[key] - want[key]))
    assert {"critic/value_loss", "critic/values_mean", "critic/grad_norm"} <= set(diffs), diffs
    assert diffs["critic/step"] == 0
    assert max(diffs.values()) <= 1e-5, diffs  # measured: 2.3e-7 (critic/grad_norm)
    a = load_file(str(run.weights.get(2).file("model.safetensors")))
    b = load_file(str(ref.weights.get(2).file("model.safetensors")))
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"critic group vs one process: metrics {diffs}, actor weights {worst:.2e}")
    assert worst <= 1e-5, worst  # measured: 7.8e-7
