"""Training a tiny random Qwen3-MoE with the Megatron actor: expert parallelism, the load-balancing
aux loss, MoE metrics, checkpoints across EP sizes (real megatron-core, gloo, alltoall dispatcher).

tests/scripts/moe_train_check.py runs once at EP=2 on the session's two-rank worker (the two
data-parallel ranks pack 2 and 1 micro-batches: the actor pads the short one so their all-to-alls
stay in step) and once at EP=1 in this process, where it also loads the state saved at EP=2. The
tests compare what they wrote. Plus the one-line refusals of an expert-parallel size that cannot work.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.helpers import SCRIPTS, run_script_in_process, slimectl_in_process

pytestmark = pytest.mark.xdist_group("two_ranks")

TOL = 1e-4
AUX = 0.5  # large enough that the aux loss's gradient shows next to a GRPO step's
CHECK = SCRIPTS / "moe_train_check.py"


def result(proc) -> dict:
    return [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1]


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    from slimectl.starter_models.tiny_models import build_tiny_model

    return build_tiny_model("qwen3-moe", tmp_path_factory.mktemp("hf") / "moe", initializer_range=0.3, seed=3,
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.fixture(scope="module")
def ep2(moe, tmp_path_factory, two_ranks) -> dict:
    return result(two_ranks.run(CHECK, str(moe), str(tmp_path_factory.mktemp("ep2")), str(AUX), timeout=600))


@pytest.fixture(scope="module")
def ep1(moe, ep2, tmp_path_factory) -> dict:
    return result(run_script_in_process(CHECK, str(moe), str(tmp_path_factory.mktemp("ep1")), str(AUX), ep2["state"]))


def weights(res: dict, name: str) -> dict[str, torch.Tensor]:
    return torch.load(res[name]["weights"], weights_only=True)


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def close_step(a: dict, b: dict) -> None:
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm"):
        assert abs(a[key] - b[key]) <= TOL, (key, a[key], b[key])


def test_an_ep2_step_matches_ep1(ep1, ep2):
    assert ep2["micro_batches"] == [2, 1]  # uneven: rank 1 runs a padding micro-batch
    a, b = ep1["c0"], ep2["c0"]
    close_step(a["metrics"], b["metrics"])
    assert a["metrics"]["train/grad_norm"] > 0.1
    w1, w2 = weights(ep1, "c0"), weights(ep2, "c0")
    assert len([k for k in w2 if ".experts." in k]) == 2 * 4 * 3  # every expert back on rank 0
    assert max_diff(w1, w2) <= TOL
    assert max_diff(w1, torch.load(Path(ep1["c0"]["weights"]).parent / "ep1_c0.pt")) == 0.0
    # the routing is the same token by token: the experts' token shares agree
    for e in range(4):
        key = f"train/moe_expert_share/{e}"
        assert a["metrics"][key] == pytest.approx(b["metrics"][key], abs=1e-9)
    assert sum(a["metrics"][f"train/moe_expert_share/{e}"] for e in range(4)) == pytest.approx(1.0)


def test_aux_loss_is_in_the_metrics_and_the_gradient(ep1, ep2, moe):
    from safetensors.torch import load_file

    base = load_file(str(moe / "model.safetensors"))
    for res in (ep1, ep2):
        c0, aux = res["c0"]["metrics"], res["aux"]["metrics"]
        # the same forward: the same aux loss reported (a balanced router gives 1.0), the same policy loss
        assert c0["train/moe_aux_loss"] == pytest.approx(aux["train/moe_aux_loss"], abs=1e-6)
        assert c0["train/moe_aux_loss"] > 1.0 and c0["train/moe_load_imbalance"] > 1.0
        assert c0["train/loss"] == pytest.approx(aux["train/loss"], abs=1e-6)
        # ... but another gradient: the aux loss pulls on the routers (and what feeds them)
        assert abs(c0["train/grad_norm"] - aux["train/grad_norm"]) > 1e-3
        w0, wa = weights(res, "c0"), weights(res, "aux")
        gates = [k for k in w0 if k.endswith(".mlp.gate.weight")]
        assert len(gates) == 2 and all(float((w0[k] - wa[k]).abs().max()) > 1e-3 for k in gates)
        assert all(not torch.equal(w0[k], base[k]) for k in gates)


def test_checkpoint_at_ep2_resumes_bit_exactly_and_loads_at_ep1(ep1, ep2):
    for res in (ep1, ep2):  # same EP: the resumed step is the uninterrupted one, bit for bit
        assert max_diff(weights(res, "resumed"), weights(res, "resume_second")) == 0.0
        a, b = res["resumed"]["metrics"], res["resume_second"]["metrics"]
        assert {k: v for k, v in a.items() if not k.startswith("perf/")} == \
            {k: v for k, v in b.items() if not k.startswith("perf/")}
    # the EP=2 state loads at EP=1: the same weights bit for bit, and the next step agrees
    assert max_diff(weights(ep1, "loaded"), weights(ep2, "resume_first")) == 0.0
    close_step(ep1["cross"]["metrics"], ep2["resume_second"]["metrics"])
    assert max_diff(weights(ep1, "cross"), weights(ep2, "resume_second")) <= TOL
    assert ep1["cross"]["metrics"]["train/step"] == 2.0


# ----------------------------------------------------------------------------- one-line refusals


def test_expert_parallel_sizes_that_cannot_work_are_refused_in_one_line(tmp_path):
    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.megatron.provider import check_expert_parallel
    from slimectl.contract.config import build_config
    from slimectl.contract.errors import ConfigError
    from slimectl.starter_models.tiny_models import build_tiny_model

    with pytest.raises(ConfigError, match=r"train.ep \(2\) must divide train.dp \(1\)"):
        build_config({"train": {"ep": 2}})
    assert build_config({"train": {"ep": 2, "dp": 4, "moe_aux_loss_coeff": 1e-3}}).train.ep == 2
    moe = arch_from_dir(build_tiny_model("qwen3-moe", tmp_path / "moe", num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32))
    with pytest.raises(ConfigError, match=r"train.ep = 3 must divide the model's 4 experts; valid train.ep sizes: "
                                          r"1, 2, 4$"):
        check_expert_parallel(moe, 3)
    check_expert_parallel(moe, 4)
    # a dense model: refused by `slimectl train` before it launches its ranks
    init = slimectl_in_process("init", tmp_path / "run", "--tiny-model", "qwen3")
    assert init.returncode == 0, init.stderr
    res = slimectl_in_process("train", "-r", tmp_path / "run", "--set", "train.ep=2", "--set", "train.dp=2")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.ep = 2: this model (qwen3) is dense" in lines[0], res.stderr


# ----------------------------------------------------------------------------- slimectl train


def moe_rollouts(vocab: int, n: int) -> list[list]:
    """n rollouts of 8 samples (4 groups of 2, one winner each) with random tokens."""
    from slimectl.contract.samples import Sample, Status

    g = torch.Generator().manual_seed(5)
    out = []
    for rid in range(n):
        samples = []
        for idx in range(8):
            s = Sample(group_index=idx // 2, index=idx, rollout_id=rid, prompt="p",
                       tokens=torch.randint(0, vocab, (4 + idx % 3,), generator=g).tolist())
            resp = torch.randint(0, vocab, (6 + idx % 4,), generator=g).tolist()
            s.append_response_tokens(resp, [-2.0] * len(resp), True, {"weight_version": "0"})
            s.status, s.reward = Status.COMPLETED, float(idx % 2 == 0)
            samples.append(s)
        out.append(samples)
    return out


@pytest.mark.slow
def test_train_stage_with_ep2_under_torchrun_then_resumes_on_one_rank(moe, tmp_path):
    """`slimectl train` with train.ep=2, dp=2 relaunches itself under torchrun: two ranks, two
    experts each; weights/N holds every expert, the metrics the MoE figures; a one-rank rerun
    (ep=1) resumes from the EP=2 checkpoint."""
    from safetensors import safe_open

    from slimectl.contract.metrics import read_metrics
    from slimectl.contract.rundir import RunDir
    from slimectl.contract.samples import SAMPLES_FILE, write_samples

    init = slimectl_in_process("init", tmp_path / "run", "--set", f"model.path={moe}", "--set", "rollout.num_rollout=3",
                               "--set", "train.lr=1e-3", "--set", "train.ep=2", "--set", "train.dp=2",
                               "--set", "train.moe_aux_loss_coeff=0.01", "--set", "logging.tensorboard=false")
    assert init.returncode == 0, init.stderr
    run = RunDir.open(tmp_path / "run")
    for rid, samples in enumerate(moe_rollouts(json.loads((moe / "config.json").read_text())["vocab_size"], 3)):
        with run.rollouts.publish(rid, meta={"weight_version": "0"}) as d:
            write_samples(samples, d / SAMPLES_FILE)
    # the launching `slimectl train` in this process (its imports are paid already); the ranks are torchrun's
    res = slimectl_in_process("train", "-r", run.path, "--max-rollouts", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "launching 2 processes" in res.stderr
    assert run.cursor("train").read().consumed == [0, 1]
    last = run.checkpoints.get(2)
    assert json.loads((last.path / "slimectl_checkpoint.json").read_text())["saved_with"] == \
        {"tp": 1, "pp": 1, "dp": 2, "ep": 2}
    names = set()
    for f in run.weights.get(2).path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names |= set(st.keys())
    assert len({n for n in names if ".mlp.experts." in n}) == 2 * 4 * 3  # both ranks' experts
    m = read_metrics(run.metrics_path("train"))
    assert [r["step"] for r in m] == [1, 2]
    assert all(r["train/moe_aux_loss"] > 0 and r["train/moe_load_imbalance"] >= 1.0 for r in m)
    assert all(sum(r[f"train/moe_expert_share/{e}"] for e in range(4)) == pytest.approx(1.0) for r in m)
    one = slimectl_in_process("train", "-r", run.path, "--set", "train.ep=1", "--set", "train.dp=1")
    assert one.returncode == 0, one.stderr[-3000:]
    assert run.cursor("train").read().consumed == [0, 1, 2]
    assert [r["step"] for r in read_metrics(run.metrics_path("train"))] == [1, 2, 3]


# ----------------------------------------------------------------------------- slimectl rl


@pytest.mark.slow
def test_rl_trains_the_moe_model_with_ep2_and_disk_then_distributed_sync(tmp_path):
    """`slimectl rl` with train.ep=2 (dp=2): two trainer ranks (the local launcher relaunches rl
    under torchrun) on the engine of one `slimectl serve`. Rollout 0 with disk sync (weights/1 has
    every expert), then the same run resumed for rollout 1 with `--set sync.transport=distributed`
    (gloo): the trainer's rank 0 joins a weight-update group with the engine while both ranks run
    their own EP/DP groups, and pushes versions 1 and 2. Proves: both transports ran, the engine
    reports version 2, and every expert matrix the engine serves, read back by name, is bit-equal
    to the one in checkpoints/2's weights/2 (a skipped or misnamed expert keeps version 1's values)."""
    from safetensors import safe_open

    from slimectl.contract.rundir import RunDir
    from tests.helpers import assert_trained_once, post, read_jsonl, start_serve, write_config

    cfg = write_config(tmp_path, rollout={"num_rollout": 2}, sync={"transport": "disk", "verify": True},
                       train={"lr": 1e-3, "ep": 2, "dp": 2, "moe_aux_loss_coeff": 0.01})
    init = slimectl_in_process("init", tmp_path / "run", "-c", cfg, "--tiny-model", "qwen3-moe")
    assert init.returncode == 0, init.stderr[-3000:]
    run = RunDir.open(tmp_path / "run")
    serve, (url,) = start_serve(run, stderr_file=tmp_path / "serve.log")
    try:
        # the launching `slimectl rl` in this process (its imports are paid already); the ranks are torchrun's
        res = slimectl_in_process("rl", "-r", run.path, "--set", "rollout.num_rollout=1")
        assert res.returncode == 0, res.stderr[-3000:]
        assert "launching 2 processes" in res.stderr
        assert run.weights.ids() == [1]  # disk sync: rollout 0's weights published for the engine
        res = slimectl_in_process("rl", "-r", run.path, "--set", "sync.transport=distributed")
        assert res.returncode == 0, res.stderr[-3000:]
        rl_log = (run.path / "logs" / "rl.log").read_text()
        assert "disk sync" in rl_log and "distributed sync" in rl_log, rl_log[-3000:]
        assert_trained_once(run, 2)
        last = run.checkpoints.get(run.checkpoints.ids()[-1])
        saved = json.loads((last.path / "slimectl_checkpoint.json").read_text())["saved_with"]
        assert saved == {"tp": 1, "pp": 1, "dp": 2, "ep": 2}
        train = read_jsonl(run.metrics_path("train"))
        assert [r["step"] for r in train] == [1, 2]
        assert all(r["train/moe_aux_loss"] > 0 and "train/moe_expert_share/3" in r for r in train)
        syncs = read_jsonl(run.metrics_path("sync"))
        assert [r["sync/weight_version"] for r in syncs] == [0, 1, 1, 2]
        # weights/2: published with checkpoints/2 (the last rollout), never handed to the engine by disk
        with urllib.request.urlopen(f"{url}/get_model_info", timeout=30) as r:
            assert json.loads(r.read())["weight_version"] == "2"
        experts = {}
        for f in run.weights.get(2).path.glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                experts |= {n: st.get_tensor(n) for n in st.keys() if ".mlp.experts." in n}
        arch = json.loads((last.path / "slimectl_checkpoint.json").read_text())["arch"]
        assert len(experts) == arch["num_layers"] * arch["num_experts"] * 3
        for name, want in sorted(experts.items()):
            got = torch.tensor(post(url, "/get_weights_by_name", {"name": name, "truncate_size": want.shape[0]}))
            assert torch.equal(got, want.float()), name
    finally:
        serve.terminate()
        serve.wait(60)
