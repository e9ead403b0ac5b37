"""The VLM CPU demo (examples/vlm_demo.py, issue 45): its dataset (the committed Parquet is the generator's, every
image decodes and shows its label's colour, the colours balanced), its exact-word reward on hand-written answers,
its SFT warm-start samples (each prompt with its image, as the rollout import checks want them), a rollout and eval
of its config on the embedded engine, its dry run, and (pending, see QUICK) the demo end to end with the reward
rising.
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import re
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import ENV, ROOT

DEMO = ROOT / "examples" / "vlm_demo.py"


def _load_demo():
    """examples/vlm_demo.py as the module ``vlm_demo`` (so ``rollout.reward: vlm_demo:reward`` resolves to it)."""
    if "vlm_demo" not in sys.modules:
        spec = importlib.util.spec_from_file_location("vlm_demo", DEMO)
        module = importlib.util.module_from_spec(spec)
        sys.modules["vlm_demo"] = module
        spec.loader.exec_module(module)
    return sys.modules["vlm_demo"]


vlm_demo = _load_demo()


def square_colour(png: bytes) -> tuple[str | None, int]:
    """(the demo colour whose exact RGB the image holds, how many pixels of it); None when there are none or
    several colours."""
    from PIL import Image

    with Image.open(io.BytesIO(png)) as img:
        counts = {rgb: n for n, rgb in img.convert("RGB").getcolors(maxcolors=img.width * img.height)}
    found = {name: counts[rgb] for name, rgb in vlm_demo.COLOURS.items() if counts.get(rgb)}
    return (next(iter(found)), *found.values()) if len(found) == 1 else (None, 0)


def test_the_dataset_is_the_generators_every_image_shows_its_label_and_the_colours_are_balanced():
    import pyarrow.parquet as pq

    from slimectl.stages.rollout.data import load_prompts

    committed = pq.read_table(vlm_demo.DATA_FILE).to_pylist()
    assert committed == vlm_demo.make_rows()  # `vlm_demo.py --write-data` writes what is committed
    # through slimectl's own loader, as data.multimodal_keys reads it: every image decoded and checked
    rows, bad = load_prompts(str(vlm_demo.DATA_FILE), "input", "label", multimodal_keys={"image": "image"})
    assert bad == 0 and len(rows) == vlm_demo.NUM_ROWS == 256
    assert Counter(r.label for r in rows) == {c: 64 for c in vlm_demo.COLOURS}
    sizes = set()
    for r in rows:
        (img,) = r.images
        assert (img.width, img.height) == (56, 56) and r.prompt == vlm_demo.QUESTION
        colour, pixels = square_colour(img.png)
        assert colour == r.label, r.row
        assert 16 * 16 <= pixels <= 32 * 32  # one square of 16-32 px, nothing else of a demo colour
        sizes.add(pixels)
    assert len(sizes) > 10  # the squares' sizes vary
    assert len({r.images[0].sha256 for r in rows}) == 256  # and so do their places and backgrounds: no duplicate
    assert vlm_demo.make_rows(8, seed=1) != vlm_demo.make_rows(8, seed=2)


@pytest.mark.parametrize("answer, label, reward", [
    ("red", "red", 1.0), ("Red", "red", 1.0), (" red.", "red", 1.0), ("red<|im_end|>", "red", 1.0),
    ("\nYELLOW\n", "yellow", 1.0), ("blue", "green", 0.0), ("reddish", "red", 0.0), ("red red", "red", 0.0),
    ("the red", "red", 0.0), ("red!", "red", 0.0), ("", "red", 0.0), (None, "red", 0.0), ("r", "red", 0.0),
])
def test_the_reward_is_the_exact_colour_word(answer, label, reward):
    from slimectl.contract.samples import Sample
    from slimectl.rewards.hub import load_reward_function

    fn = load_reward_function("vlm_demo:reward")  # what rollout.reward names, loaded by slimectl's reward hub
    assert asyncio.run(fn(None, Sample(response=answer, label=label))) == reward


def test_the_sft_warm_start_samples_carry_their_images_as_rollout_import_checks_them(tmp_path):
    from slimectl.contract.samples import SAMPLES_FILE, read_samples
    from slimectl.stages.init import init_run
    from slimectl.stages.rollout.importer import image_check
    from slimectl.stages.rollout.media import load_stored_image
    from slimectl.stages.rollout.prompts import prepared_prompts

    run = init_run(tmp_path / "warm", ROOT / "examples" / "vlm_sft_warmstart.yaml", tiny_model="qwen2_5-vl",
                   overrides=["rollout.num_rollout=2", "rollout.batch_size=8"]).run
    cfg = run.config()
    assert cfg.data.multimodal_keys == {"image": "image"} and cfg.algorithm.loss_type == "sft_loss"
    vlm_demo.publish_sft_rollouts(run.path, seed=0)
    assert run.rollouts.ids() == [0, 1]
    rows, _, _, tok = prepared_prompts(cfg, None)
    prompts = {tuple(r.prompt_ids) for r in rows}
    check = image_check(run, cfg)
    assert check.vision_ids and not check.text_only  # the tiny Qwen2.5-VL's vision tokens: checked below
    labels = Counter()
    for rid in (0, 1):
        samples = read_samples(run.rollouts.get(rid, verify="full").file(SAMPLES_FILE))
        assert len(samples) == 8
        for s in samples:
            check(f"rollout {rid} sample {s.index}", s)  # image intact, one image per vision_start, none trained
            (sha,) = s.image_hashes
            assert square_colour(load_stored_image(run.path, sha).png)[0] == s.label
            assert tuple(s.prompt_tokens) in prompts  # the prompt ids the engine would get, images expanded
            assert tok.decode(s.response_tokens) == s.label + tok.eos_token and s.loss_mask == [1] * s.response_length
            labels[s.label] += 1
    assert set(labels) <= set(vlm_demo.COLOURS) and len(labels) >= 3
    before = [run.rollouts.get(rid).meta for rid in (0, 1)]
    vlm_demo.publish_sft_rollouts(run.path, seed=0)  # a rerun resumes: nothing published twice
    assert run.rollouts.ids() == [0, 1] and [run.rollouts.get(rid).meta for rid in (0, 1)] == before


# ------------------------------------------------------------------ with the embedded engine and `rl`

def test_a_rollout_and_eval_of_the_demo_config_against_the_embedded_engine(tmp_path):
    """`init` + `rollout` + eval of examples/vlm_demo.yaml (the untrained tiny Qwen2.5-VL) on a real embedded engine:
    every sample has its image and at most max_response_len tokens, the custom reward graded them (0 or 1), eval
    covers rows 0-31. First run by hand (2026-12-05, before `rollout` took VLMs, its switch flipped in-process): 64
    samples in 8.7 s, reward 0.0, eval 32 prompts."""
    from slimectl.contract.samples import SAMPLES_FILE, read_samples
    from slimectl.stages.init import init_run
    from slimectl.stages.rollout.eval import run_eval
    from slimectl.stages.rollout.stage import run_rollout
    from tests.helpers import start_engine, stop_engine, wait_healthy

    run = init_run(tmp_path / "run", ROOT / "examples" / "vlm_demo.yaml", tiny_model="qwen2_5-vl").run
    cfg = run.config()
    proc, url = start_engine(Path(cfg.model.path), tmp_path / "engine.log")
    try:
        wait_healthy(url)
        res = run_rollout(run, cfg, engine_urls=[url])
        samples = read_samples(run.rollouts.get(res.rollout_id).file(SAMPLES_FILE))
        assert len(samples) == cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt == 64
        for s in samples:
            assert len(s.image_hashes) == 1 and 1 <= s.response_length <= cfg.rollout.max_response_len
            assert s.reward == vlm_demo.grade(s.response, s.label) and s.label in vlm_demo.COLOURS
        metrics = run_eval(run, cfg, 0, [url])
        assert metrics["eval/colours/num_prompts"] == 32 and 0 <= metrics["eval/colours/pass@1"] <= 1
    finally:
        stop_engine(proc)


# The demo's arguments for the end-to-end test: a 70-step SFT warm start (warm-start reward ~0.25: the model names
# colours but barely tells them apart; 100 steps would leave less room) and 100 GRPO rollouts at the demo's lr 6e-4
# linear, eval at 50 and 100. Measured 2026-12-05 (seed 0, one run through to the end, on a 2-core machine shared
# with other test suites, load 10-26): first 20% of rollouts 0.255, last 20% 0.462 (+0.207); eval pass@1 0.398 at
# version 50, 0.391 at 100 (pass@4 0.656 both); `rl` 194.5 s, the whole script ~13 min at that load (SFT ~8 min of
# it: 3.8-9.4 s a step loaded). The rollouts repeat exactly from run to run (two earlier runs, stopped by the bugs
# fixed then, gave the same rewards for rollouts 0-11). This test with QUICK: passed once, 247 s wall (119 CPU-s) at
# load ~18, 2026-12-05. Seeds 1/2 not measured: the margin over 0.2 is thin.
# Earlier evidence (plain HF SFT): 0.25 greedy accuracy at 50 steps of batch 32, lr 3e-3, 0.75 at 100.
QUICK: list[str] = ["--sft-steps", "70", "--set", "rollout.num_rollout=100", "--set", "rollout.eval_interval=50"]
QUICK_ROLLOUTS = 100
QUICK_EVALS = [50, 100]


def test_the_demo_defaults_resolve_without_running(tmp_path, stage_forks):
    """`vlm_demo.py --dry-run`: the warm start's and the RL run's configs resolve; nothing is written."""
    import yaml

    run = tmp_path / "demo"
    proc = subprocess.run([*shlex.split(stage_forks.command("python")), str(DEMO), str(run), "--dry-run"],
                          capture_output=True, text=True, timeout=120,
                          env={**ENV, "SLIMECTL": stage_forks.command("slimectl")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    warm, rl = yaml.safe_load_all(proc.stdout)
    assert warm["name"] == "vlm-demo-warmstart" and warm["algorithm"]["loss_type"] == "sft_loss"
    assert warm["model"]["path"] == str(run) + "-warmstart/models/tiny-qwen2_5-vl"
    assert rl["name"] == "vlm-demo" and rl["model"]["path"] == str(run) + "-warmstart/weights/000100"
    assert rl["data"]["multimodal_keys"] == warm["data"]["multimodal_keys"] == {"image": "image"}
    assert rl["rollout"]["reward"] == "vlm_demo:reward" and rl["engine"]["backend"] == "embedded"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_vlm_demo_runs_rl_end_to_end_and_reward_rises(tmp_path, stage_forks):
    """The demo with QUICK: SFT warm start, `slimectl rl` for QUICK_ROLLOUTS rollouts, eval, plot — and the mean
    reward of the last 20% of rollouts beats the first 20% by 0.2 (issue 45's "the demo's reward rises")."""
    from slimectl.contract.rundir import RunDir

    python, slimectl = (shlex.split(stage_forks.command(m)) for m in ("python", "slimectl"))
    proc = subprocess.run([*python, str(DEMO), str(tmp_path / "demo"), *QUICK], capture_output=True, text=True,
                          timeout=1500, env={**ENV, "SLIMECTL": shlex.join(slimectl)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = RunDir.open(tmp_path / "demo")
    assert run.cursor("train").read().consumed == list(range(QUICK_ROLLOUTS))
    assert run.evals.ids() == QUICK_EVALS and run.engines.list() == []
    first, last = map(float, re.search(r"first 20% of rollouts ([\d.]+), last 20% ([\d.]+)", proc.stdout).groups())
    assert last >= first + 0.2, proc.stdout[-1500:]
    png = run.path / "plots" / "curves.png"
    assert proc.stdout.strip().splitlines()[-1] == str(png) and png.stat().st_size > 10_000
