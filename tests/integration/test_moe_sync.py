"""Weight sync of a mixture-of-experts model (issue #20, item 4).

transformers 5 holds a Qwen3-MoE layer's experts fused in memory (3-D ``mlp.experts.gate_up_proj``
and ``mlp.experts.down_proj``) while checkpoints, exports and the trainer name them per expert
(``mlp.experts.E.gate_proj.weight`` ...). The embedded engine maps one onto the other
(``engines/embedded/weights.py::fused_expert_views``): disk sync, gloo sync and ``sync --verify``
all work by per-expert names. One ``slimectl serve`` engine on a tiny qwen3-moe model is shared by
the module; the layout and error tests run on in-process runners.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import urllib.error
import urllib.request

import pytest
import torch

from slimectl.contract.rundir import RunDir
from slimectl.engines.embedded.weights import fused_expert_views
from tests.helpers import load_tensors, post, slimectl_in_process, start_serve

pytestmark = pytest.mark.xdist_group("moe_sync")  # xdist: one worker, the engine started once

PROMPT = [5, 6, 7, 8]
NEW = 12


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def publish_moe_weights(run, version: int, seed: int) -> dict:
    """weights/VERSION: the run's model with noise on every tensor and the experts and routers drawn
    afresh, large enough to dominate the output (tests/helpers.py::publish_weights's small noise
    leaves this tiny tied model repeating its last prompt token whatever the experts hold)."""
    from safetensors.torch import load_file

    from slimectl.backends.hf.checkpoint import write_safetensors_sharded
    from slimectl.backends.megatron.checkpoint import copy_hf_aux_files

    model = run.config().model.path
    g = torch.Generator().manual_seed(seed)
    new = {}
    for k, v in load_file(f"{model}/model.safetensors").items():
        if is_expert(k):
            new[k] = 0.3 * torch.randn(v.shape, generator=g)
        elif ".mlp.gate." in k:  # the router
            new[k] = torch.randn(v.shape, generator=g)
        else:
            new[k] = v + 0.3 * torch.randn(v.shape, generator=g) * (v.std() if v.numel() > 1 else 1.0)
    with run.weights.publish(version, meta={"weight_version": version}) as d:
        write_safetensors_sharded(new.items(), d)
        copy_hf_aux_files(model, d)
    return new


def engine_greedy(url: str) -> tuple[list[int], list[float], str]:
    out = post(url, "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                  "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
    return out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]], out["meta_info"]["weight_version"]


def hf_greedy(model_dir) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs from plain transformers on the weights in ``model_dir``."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    seq, lps = list(PROMPT), []
    with torch.inference_mode():
        for _ in range(NEW):
            lp = torch.log_softmax(m(input_ids=torch.tensor([seq])).logits[0, -1].float(), -1)
            t = int(lp.argmax())
            seq.append(t)
            lps.append(float(lp[t]))
    return seq[len(PROMPT):], lps


def post_error(url: str, path: str, body) -> str:
    """The message of a request the engine refuses (HTTP 400)."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 400
    answer = json.loads(info.value.read())
    return answer.get("message") or answer["error"]["message"]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A run with a tiny qwen3-moe model (4 experts, 2 layers), weights/1 and weights/2 (noise on
    every tensor, new experts)."""
    root = tmp_path_factory.mktemp("moe_sync")
    res = slimectl_in_process("init", root / "run", "--tiny-model", "qwen3-moe", "--set", "logging.tensorboard=false")
    assert res.returncode == 0, res.stderr
    run = RunDir.open(root / "run")
    weights = {1: publish_moe_weights(run, 1, 1), 2: publish_moe_weights(run, 2, 2)}
    assert sum(map(is_expert, weights[1])) == 2 * 4 * 3  # per-expert names on disk
    return run, weights


@pytest.fixture(scope="module")
def served(moe_run):
    """`slimectl serve` with one engine on the run: (run, url, weights)."""
    run, weights = moe_run
    proc, urls = start_serve(run)
    try:
        yield run, urls[0], weights
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_disk_sync_of_moe_weights_gives_what_transformers_gives(served):
    run, url, _ = served
    assert slimectl_in_process("sync", "-r", run.path, "--version", "0").returncode == 0
    before, _, v = engine_greedy(url)
    assert v == "0"
    res = slimectl_in_process("sync", "-r", run.path, "--version", "1", "--verify")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "verified" in res.stdout
    ids, lps, v = engine_greedy(url)
    ref_ids, ref_lps = hf_greedy(run.weights.get(1).path)
    assert v == "1" and ids == ref_ids != before
    assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4


def test_distributed_sync_carries_every_expert(served):
    run, url, weights = served
    for version in (0, 2):  # the engine held other experts before the second push
        res = slimectl_in_process("sync", "-r", run.path, "--version", version, "--transport", "distributed",
                                  "--set", "sync.bucket_size_mb=1")
        assert res.returncode == 0, res.stderr[-3000:]
    experts = sorted(n for n in weights[2] if is_expert(n))
    for name in experts:  # every expert's every matrix, whole, bit for bit (the engine serves fp32)
        got = torch.tensor(post(url, "/get_weights_by_name", {"name": name, "truncate_size": 1000}))
        assert torch.equal(got, weights[2][name]), name
    ids, _, v = engine_greedy(url)
    assert v == "2" and ids == hf_greedy(run.weights.get(2).path)[0]


def test_verify_reads_experts_back_and_catches_a_wrong_one(served):
    from slimectl.engines.client import EngineClient
    from slimectl.stages.sync import WeightSource
    from slimectl.stages.sync.verify import pick_names, verify_engines

    run, url, weights = served
    res = slimectl_in_process("sync", "-r", run.path, "--version", "2", "--verify")
    assert res.returncode == 0 and "verified" in res.stdout, res.stderr[-2000:]
    assert sum(map(is_expert, pick_names(list(weights[2])))) >= 2  # the default sample reads experts back

    def check(tensors: dict):
        async def go():
            async with EngineClient(url) as c:
                return await verify_engines({url: c}, WeightSource.from_tensors(2, lambda: iter(tensors.items())),
                                            num_tensors=len(tensors))
        return asyncio.run(go())

    report = check(weights[2])  # every tensor, each of the 24 expert matrices included
    assert report == [] and report.verified and report.skipped == 0 and report.checked == len(weights[2])
    wrong = dict(weights[2])
    bad = "model.layers.1.mlp.experts.2.up_proj.weight"
    wrong[bad] = wrong[bad].clone()
    wrong[bad][0, 0] += 1.0
    gate = "model.layers.0.mlp.experts.3.gate_proj.weight"
    up = gate.replace("gate_proj", "up_proj")
    wrong[gate], wrong[up] = weights[2][up], weights[2][gate]  # the halves of the fused tensor swapped
    problems = check(wrong)
    assert sorted(p.split(" weight ")[1].split()[0] for p in problems) == sorted([bad, gate, up])
    assert all("differs from weight version 2" in p for p in problems)


def test_refused_updates_name_the_expert(served, tmp_path):
    run, url, weights = served
    assert slimectl_in_process("sync", "-r", run.path, "--version", "1").returncode == 0
    # a checkpoint without one expert's up_proj: refused, naming it, and nothing changes
    src = run.weights.get(2).path
    partial = tmp_path / "partial"
    shutil.copytree(src, partial)
    from safetensors.torch import load_file, save_file

    for f in partial.glob("*.safetensors"):
        sd = load_file(f)
        sd.pop("model.layers.1.mlp.experts.3.up_proj.weight", None)
        save_file(sd, f, metadata={"format": "pt"})
    msg = post_error(url, "/update_weights_from_disk", {"model_path": str(partial), "weight_version": "9"})
    assert "is missing parameter 'model.layers.1.mlp.experts.3.up_proj.weight'" in msg
    assert engine_greedy(url)[2] == "1"
    # names matching nothing still fail as before
    assert post_error(url, "/get_weights_by_name", {"name": "model.layers.0.mlp.experts.4.gate_proj.weight"}) == \
        "Get parameter by name failed"
    got = post(url, "/get_weights_by_name", {"name": "model.layers.0.mlp.experts.3.down_proj.weight", "truncate_size": 2})
    assert torch.equal(torch.tensor(got), weights[1]["model.layers.0.mlp.experts.3.down_proj.weight"][:2])


# ------------------------------------------------------------------------------------------------
# In-process: the layout, checked against transformers' own loading


@pytest.fixture(scope="module")
def scheduler(moe_run):
    from slimectl.engines.embedded.scheduler import GenerationScheduler

    r = GenerationScheduler(str(moe_run[0].config().model.path), max_batch_size=2)
    r.start()
    yield r
    r.stop()


def test_views_are_the_slices_transformers_loads_per_expert_tensors_into(moe_run):
    """Load weights/1 (per-expert tensors on disk) with from_pretrained: each per-expert view of the
    fused parameters is exactly the tensor on disk (gate rows first, then up; not transposed)."""
    from transformers import AutoModelForCausalLM

    run, weights = moe_run
    model = AutoModelForCausalLM.from_pretrained(str(run.weights.get(1).path), dtype=torch.float32)
    views = fused_expert_views(model)
    assert sorted(views) == sorted(n for n in weights[1] if is_expert(n))
    for name, (fused, view) in views.items():
        assert fused.endswith(("experts.gate_up_proj", "experts.down_proj"))
        assert torch.equal(view, weights[1][name]), name
    gu = dict(model.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"]
    up = views["model.layers.1.mlp.experts.2.up_proj.weight"][1]
    assert up[1].data_ptr() == gu[2, gu.shape[1] // 2 + 1].data_ptr()  # a view: writing it writes the parameter


def test_other_fused_layouts_follow_the_module_flags():
    """Transposed, interleaved [gate0, up0, gate1, ...] and biased experts (other transformers families)."""
    class Experts(torch.nn.Module):
        is_transposed, is_concatenated, has_bias, has_gate = True, False, True, True

        def __init__(self, e=3, h=4, i=2):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(e, h, 2 * i))  # [E, in, out]
            self.down_proj = torch.nn.Parameter(torch.randn(e, i, h))
            self.gate_up_proj_bias = torch.nn.Parameter(torch.randn(e, 2 * i))
            self.down_proj_bias = torch.nn.Parameter(torch.randn(e, h))

    m = torch.nn.Module()
    m.experts = Experts()
    views = {n: v for n, (_, v) in fused_expert_views(m).items()}
    assert len(views) == 3 * 6
    x = m.experts
    assert views["experts.1.gate_proj.weight"].shape == (2, 4)  # HF's [out, in]
    assert torch.equal(views["experts.1.gate_proj.weight"][1], x.gate_up_proj[1, :, 2].detach())  # gate row 1
    assert torch.equal(views["experts.1.up_proj.weight"][0], x.gate_up_proj[1, :, 1].detach())  # up row 0
    assert torch.equal(views["experts.2.down_proj.weight"], x.down_proj[2].detach().t())
    assert torch.equal(views["experts.0.up_proj.bias"], x.gate_up_proj_bias[0, 1::2].detach())
    assert torch.equal(views["experts.0.down_proj.bias"], x.down_proj_bias[0].detach())


def test_scheduler_updates_and_receives_slices_by_expert_name(scheduler, moe_run):
    _, weights = moe_run
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    fused = scheduler.weights.params["model.layers.0.mlp.experts.gate_up_proj"]
    i = fused.shape[1] // 2
    gate_before = fused[1, :i].clone()
    load_tensors(scheduler, [(name, weights[2][name])], weight_version="a")
    assert torch.equal(fused[1, i:], weights[2][name]) and torch.equal(fused[1, :i], gate_before)
    new = torch.full_like(weights[2][name], 0.5)
    scheduler.receive_weights([(name, torch.float32, tuple(new.shape))], lambda t: t.copy_(new), "b")
    assert torch.equal(fused[1, i:], new) and torch.equal(torch.tensor(scheduler.get_weights_by_name(name)), new)
    with pytest.raises(ValueError, match="unknown parameter name 'model.layers.0.mlp.experts.4.up_proj.weight'"):
        scheduler.receive_weights([(name.replace(".1.", ".4."), torch.float32, (1,))], lambda t: None, "c")
    with pytest.raises(ValueError, match=f"shape mismatch for '{name}'"):
        load_tensors(scheduler, [(name, torch.zeros(3, 3))])
    assert scheduler.weight_version == "b"
