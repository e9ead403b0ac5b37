"""Issue 45 through the CLI: `init --tiny-model qwen2_5-vl | qwen3-vl` builds a run that every stage takes (none
refuses a vision-language model any more), and a rollout import whose image is not in the run is one line, exit 2,
nothing published."""

from __future__ import annotations

import io
import json

import pytest

from tests.helpers import slimectl_in_process

# every stage takes a VLM now: serve (tests/integration/test_embedded_vlm_http.py), convert and export
# (tests/integration/test_vlm_megatron.py), rollout, train, sync and rl (tests/integration/test_vlm_rl.py)
STAGES = {"rollout": "data.prompt_data is not set", "train": "rollouts/000000 is not published yet",
          "sync": "no live engines registered"}


def _error_line(res) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert lines and lines[-1].startswith("Error: "), res.stderr[-2000:]
    errors = [ln for ln in lines if ln.startswith("Error")]
    assert len(errors) == 1, errors
    return lines[-1]


def _published(run) -> list[str]:
    return sorted(str(p.relative_to(run)) for kind in ("checkpoints", "rollouts", "weights", "exports")
                  for p in (run / kind).glob("*") if (run / kind).is_dir() and not p.name.startswith("."))


@pytest.fixture(scope="module", params=["qwen2_5-vl", "qwen3-vl"])
def vlm_run(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(f"vlm-{family}")
    res = slimectl_in_process("init", root / "run", "--tiny-model", family, env={"HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    return family, root / "run"


def test_init_builds_the_tiny_vlm_into_the_run(vlm_run):
    family, run = vlm_run
    model = run / "models" / f"tiny-{family}"
    cfg = json.loads((model / "config.json").read_text())
    assert "vision_config" in cfg and cfg["model_type"] == family.replace("-", "_")
    assert (model / "processor_config.json").is_file() and (model / "model.safetensors").is_file()


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_takes_a_vlm_and_says_what_it_lacks(vlm_run, stage):
    """No stage refuses a VLM any more: on a fresh run each names what it lacks (no data, no rollout, no engine)."""
    family, run = vlm_run
    res = slimectl_in_process(stage, "-r", run)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("Error")]
    assert res.returncode != 0 and len(errors) == 1 and STAGES[stage] in errors[0], res.stderr[-2000:]
    assert "vision-language" not in res.stderr
    assert _published(run) == []


def test_rollout_import_of_a_vlm_sample_whose_image_is_not_in_the_run_is_one_line(vlm_run, tmp_path):
    family, run = vlm_run
    samples = tmp_path / "s.jsonl"
    sha = "ab" * 32
    samples.write_text(json.dumps({"group_index": 0, "index": 0, "tokens": [512, 515, 513, 6, 7], "response_length": 2,
                                   "reward": 1.0, "rollout_log_probs": [-1.0, -2.0], "loss_mask": [1, 1],
                                   "multimodal_inputs": {"image": [sha]}}) + "\n")
    line = _error_line(slimectl_in_process("rollout", "import", samples, "-r", run))
    assert f"{samples}:1: its image {sha} is not in the run's media/" in line and "does not exist" in line, line
    assert _published(run) == []


def test_images_for_a_text_only_model_are_refused_before_any_engine(tmp_path):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (28, 28), "red").save(buf, format="PNG")
    (tmp_path / "red.png").write_bytes(buf.getvalue())
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"input": "Colour?", "label": "red", "images": "red.png"}) + "\n")
    run = tmp_path / "run"
    res = slimectl_in_process("init", run, "--tiny-model", "qwen2", "--set", f"data.prompt_data={data}",
                              "--set", "data.multimodal_keys={image: images}", env={"HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    line = _error_line(slimectl_in_process("rollout", "-r", run))
    assert "data.multimodal_keys = {'image': 'images'} gives the prompts images" in line
    assert "(qwen2) is a text-only model" in line, line
    assert _published(run) == []
    # rl checks the data before it writes anything: no run directory is left behind
    cfg = tmp_path / "rl.yaml"
    cfg.write_text(f"model:\n  path: {run / 'models' / 'tiny-qwen2'}\ndata:\n  prompt_data: {data}\n"
                   f"  multimodal_keys: {{image: images}}\nrollout:\n  num_rollout: 1\n")
    line = _error_line(slimectl_in_process("rl", "-c", cfg, "-r", tmp_path / "rl-run"))
    assert "(qwen2) is a text-only model" in line, line
    assert not (tmp_path / "rl-run").exists()
