"""``slimectl rl`` on a VLM (issue 45): two iterations (rollout -> train -> sync) of the tiny Qwen2.5-VL on a
synthetic image dataset (tiny images made here), the disk sync verified; then a distributed sync of the last
weights into a fresh engine, whose every tensor, vision tower and merger included, is then the published
version's bit for bit; and a third iteration whose sync streams the trainer's tensors (distributed). What a VLM is not trained with yet (LoRA, PPO's critic, fully_async) is one line, exit 2,
before anything is written."""

from __future__ import annotations

import io
import json

import pytest
import torch

from slimectl.contract.rundir import RunDir
from tests.helpers import post, slimectl_in_process, start_engine, stop_engine, wait_healthy, write_config

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


def _dataset(tmp) -> tuple:
    """Six prompts "Which colour is this?" over tiny solid images (28..56 px: 1 to 4 image tokens)."""
    from PIL import Image

    rows = []
    for i, (name, rgb) in enumerate(list(COLOURS.items()) * 2):
        path = tmp / f"{name}{i}.png"
        buf = io.BytesIO()
        Image.new("RGB", (28 + 28 * (i % 2), 28 + 28 * (i // 3)), rgb).save(buf, format="PNG")
        path.write_bytes(buf.getvalue())
        rows.append({"input": "<image>Which colour is this?", "label": name, "images": [path.name]})
    data = tmp / "colours.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def _one_line(res) -> str:
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("Error")]
    assert res.returncode == 2 and len(errors) == 1, (res.returncode, res.stderr[-2000:])
    return errors[0]


@pytest.fixture(scope="module")
def vlm_rl(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlm_rl")
    data = _dataset(tmp)
    cfg = write_config(tmp, data={"prompt_data": str(data), "multimodal_keys": {"image": "images"},
                                  "shuffle": False},
                       rollout={"num_rollout": 2, "batch_size": 2, "n_samples_per_prompt": 2, "max_response_len": 4},
                       train={"lr": 1e-2}, sync={"verify": True})
    res = slimectl_in_process("rl", "-c", cfg, "-r", tmp / "run", "--tiny-model", "qwen2_5-vl",
                              env={"HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-4000:]
    return RunDir.open(tmp / "run"), res


def _tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_rl_trains_a_vlm_for_two_iterations_and_syncs_the_vision_weights(vlm_rl):
    run, res = vlm_rl
    cur = run.cursor("train").read()  # (>= 2: the distributed test below goes on to a third)
    assert cur.next >= 2 and run.rollouts.ids()[:2] == [0, 1]
    from slimectl.contract.samples import SAMPLES_FILE, read_samples

    samples = read_samples(run.rollouts.get(1).file(SAMPLES_FILE))
    assert samples and all(len(s.image_hashes) == 1 for s in samples)  # images all the way through
    syncs = [json.loads(ln) for ln in run.metrics_path("sync").read_text().splitlines()]
    assert [r["sync/weight_version"] for r in syncs][:3] == [0, 1, 2]
    assert all("sync/verify_time" in r for r in syncs)  # each sync verified: sampled tensors read back, equal
    # the published weights hold the trained vision tower: it moved from the initial model's
    model = run.config().model.path
    first, last = _tensors(type(run.path)(model)), _tensors(run.weights.get(2).path)
    assert set(first) == set(last)
    vision = [n for n in first if n.startswith("visual.")]
    assert vision and any(not torch.equal(first[n], last[n]) for n in vision)


def test_a_distributed_sync_moves_every_vision_tensor_bit_for_bit(vlm_rl, tmp_path):
    """A fresh engine on the initial model, then ``sync`` (distributed, verified) of weights/2: every tensor the
    engine serves is weights/2's, bit for bit."""
    from slimectl.stages.sync.stage import run_sync

    run, _ = vlm_rl
    cfg = run.config()
    proc, url = start_engine(cfg.model.path, tmp_path / "engine.log")
    try:
        wait_healthy(url)
        result = run_sync(run, cfg, 2, transport="distributed", verify=True, engine_urls=[url])
        assert result.version == 2 and result.verified
        want = _tensors(run.weights.get(2).path)
        differ = []
        for name, t in want.items():
            got = torch.tensor(post(url, "/get_weights_by_name", {"name": name, "truncate_size": t.shape[0]}))
            if not torch.equal(got.to(t.dtype).reshape(t.shape), t):
                differ.append(name)
        assert any(n.startswith("visual.") for n in want) and differ == []
    finally:
        stop_engine(proc)


@pytest.mark.parametrize("sets,says", [
    (("train.lora={rank: 4}",), "train.lora (LoRA) is not supported with a vision-language model"),
    (("algorithm.advantage_estimator=ppo",), "algorithm.advantage_estimator: ppo (a critic) is not supported"),
    (("rollout.async_mode=fully_async",), "rollout.async_mode: fully_async is not supported"),
])
def test_what_a_vlm_is_not_trained_with_is_one_line(vlm_rl, tmp_path, sets, says):
    run, _ = vlm_rl
    cfg = tmp_path / "rl.yaml"
    cfg.write_text(f"model:\n  path: {run.config().model.path}\nrollout:\n  num_rollout: 1\n")
    args = [a for s in sets for a in ("--set", s)]
    line = _one_line(slimectl_in_process("rl", "-c", cfg, "-r", tmp_path / "run", *args))
    assert says in line and "`slimectl rl`" in line and "qwen2_5_vl" in line, line
    assert not (tmp_path / "run").exists()


def test_train_refuses_lora_on_a_vlm_in_one_line(vlm_rl):
    run, _ = vlm_rl
    before = run.checkpoints.ids()
    line = _one_line(slimectl_in_process("train", "-r", run.path, "--set", "train.lora={rank: 4}"))
    assert "train.lora (LoRA) is not supported with a vision-language model in `slimectl train`" in line, line
    assert run.checkpoints.ids() == before


def test_rl_goes_on_with_a_distributed_sync_of_the_trainers_tensors(vlm_rl):
    """A third iteration with ``sync.transport: distributed``: the trainer streams its tensors (vision tower
    included) into the engine; the sync is verified."""
    run, _ = vlm_rl
    res = slimectl_in_process("rl", "-r", run.path, "--set", "rollout.num_rollout=3", "--set",
                              "sync.transport=distributed")
    assert res.returncode == 0, res.stderr[-4000:]
    assert run.cursor("train").read().next == 3
    syncs = [json.loads(ln) for ln in run.metrics_path("sync").read_text().splitlines()]
    assert [r["sync/weight_version"] for r in syncs][-2:] == [2, 3] and "sync/verify_time" in syncs[-1]
    assert "distributed sync" in (run.path / "logs" / "rl.log").read_text()
