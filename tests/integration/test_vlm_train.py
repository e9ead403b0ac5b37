"""Training a VLM (issue 45): a real rollout of the tiny Qwen2.5-VL against the embedded engine, then the trainer's
log-probs of the same samples with their images and M-RoPE positions (step 0: the engine's, fp32, within 1e-5), and
a training step on them; the tiny Qwen3-VL likewise (interleaved M-RoPE, deepstack)."""

from __future__ import annotations

import io
import json

import pytest
import torch

from slimectl.contract.samples import SAMPLES_FILE, read_samples
from slimectl.stages.rollout import stage as rollout_stage
from tests.helpers import in_process_stage


def _png(color: str, size: tuple[int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module", params=["qwen2_5-vl", "qwen3-vl"])
def vlm_rollout(request, tmp_path_factory):
    """A tiny Qwen2.5-VL / Qwen3-VL, a prompt set of two images, one image and none, and rollout 0 of it
    (temperature 1, 2 samples per prompt) from a real embedded engine."""
    from slimectl.stages.init import init_run
    from slimectl.starter_models.tiny_models import build_tiny_model
    from tests.helpers import start_engine, stop_engine, wait_healthy

    root = tmp_path_factory.mktemp(f"vlm_train_{request.param}")
    model = build_tiny_model(request.param, root / "model")
    (root / "red.png").write_bytes(_png("red", (96, 64)))  # 6 image tokens (qwen3-vl; qwen2_5-vl: 6 too)
    (root / "blue.png").write_bytes(_png("blue", (64, 64)))  # 4
    data = root / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [
        {"input": "<image> or <image>: which is red?", "label": "1", "images": ["red.png", "blue.png"]},
        {"input": "Colour?", "label": "2", "images": "blue.png"},
        {"input": "No picture here.", "label": "3", "images": None}]))
    run = init_run(root / "run", overrides=[
        f"model.path={model}", f"data.prompt_data={data}", "data.multimodal_keys={image: images}",
        "rollout.reward=random", "rollout.batch_size=3", "rollout.n_samples_per_prompt=2",
        "rollout.max_response_len=6", "rollout.temperature=1.0", "data.shuffle=false"]).run
    proc, url = start_engine(model, root / "engine.log")
    try:
        wait_healthy(url)
        rollout_stage.run_rollout(run, run.config(), engine_urls=[url])
    finally:
        stop_engine(proc)
    return model, run, read_samples(run.rollouts.get(0).file(SAMPLES_FILE))


def _actor(model, **train):
    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.megatron.actor import MegatronActor
    from slimectl.contract.config_schema import AlgorithmSection, TrainSection

    arch = arch_from_dir(model)
    a = MegatronActor(arch, arch.padded_vocab_size(1), TrainSection(**train), AlgorithmSection())
    a.load_hf(model)
    return a


def test_step0_train_log_probs_with_the_images_are_the_engines(vlm_rollout):
    """The trainer's fp32 log-probs of every response token, with each sample's images and M-RoPE positions, are
    the engine's (max |diff| <= 1e-5); without the images (M-RoPE positions as text) they are not."""
    from slimectl.backends.hf.vlm import vlm_family
    from slimectl.stages.train.vision import SampleVision

    model, run, samples = vlm_rollout
    assert [len(s.image_hashes) for s in samples] == [2, 2, 1, 1, 0, 0]
    vision = SampleVision(run.path, model).inputs(samples, 0)
    with in_process_stage():
        actor = _actor(model, max_tokens_per_micro_batch=64)  # several micro-batches, sequences packed
        lp = actor.compute_log_probs(samples, 1.0, vision=vision)
        diffs = [(x - torch.tensor(s.rollout_log_probs)).abs().max().item() for x, s in zip(lp, samples)]
        print(f"\nstep-0 train vs engine log-probs (fp32, tiny {vlm_family(model)}, {sum(s.response_length for s in samples)} "
              f"response tokens): max |diff| {max(diffs):.2e}")
        assert max(diffs) <= 1e-5, diffs
        # M-RoPE is what agrees: the same images at 1-D text positions are far off
        from slimectl.backends.hf.vlm_inputs import VisionInputs

        flat = [VisionInputs(v.pixel_values, v.image_grid_thw, torch.arange(len(s.tokens)).expand(3, -1).clone())
                for v, s in zip(vision, samples)]
        lp_flat = actor.compute_log_probs(samples[:4], 1.0, vision=flat[:4])
        assert max((x - y).abs().max().item() for x, y in zip(lp_flat, lp)) > 1e-4

def test_a_training_step_on_a_vlm_rollout_moves_the_vision_tower_unless_frozen(vlm_rollout):
    """A step trains the vision tower and the language model; with ``train.freeze: [vision]`` the tower stays
    bit for bit and the language model still moves."""
    from slimectl.stages.train.vision import SampleVision

    model, run, samples = vlm_rollout
    vision = SampleVision(run.path, model).inputs(samples, 0)
    for s in samples:  # rewards that differ within each group: non-zero advantages
        s.reward = float(s.index % 2)
    moved = {}
    with in_process_stage():
        for freeze in ((), ("vision",)):
            actor = _actor(model, max_tokens_per_micro_batch=64, lr=1e-2, freeze=list(freeze))
            before = {n: p.detach().clone() for n, p in actor.module.named_parameters()}
            steps = actor.train_on_samples(samples, 1.0, vision=vision)
            assert len(steps) == 1 and steps[0]["train/grad_norm"] > 0
            changed = {n for n, p in actor.module.named_parameters() if not torch.equal(before[n], p.detach())}
            moved[freeze] = ({n for n in changed if n.startswith("vision.")},
                             {n for n in changed if not n.startswith("vision.")})
    assert moved[()][0] and moved[()][1]
    assert not moved[("vision",)][0] and moved[("vision",)][1]
