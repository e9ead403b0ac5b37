"""The rollout buffer with VLM samples (issue 45): a trajectory's images (``multimodal_inputs``) are checked by the rules
of ``rollout import`` — by the service when it is served with ``-r RUN`` (the write is refused, nothing is stored) and
by ``rollout --source buffer`` before it publishes (one line, exit 2, nothing published, the groups handed back)."""

from __future__ import annotations

import io

import pytest

from slimectl.contract.errors import UsageError
from slimectl.contract.samples import SAMPLES_FILE, read_samples
from tests.integration.test_rollout_buffer import N, Buffer


def _png(color: str, size: tuple[int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def vlm_run(tmp_path):
    """A run of the tiny Qwen2.5-VL with one image (red) stored in its RUN/media, one (blue) not; trajectories of
    each: one image in the prompt, two response tokens trained on."""
    from slimectl.backends.hf.vlm import load_processor
    from slimectl.stages.init import init_run
    from slimectl.stages.rollout.media import decode_image, store_images
    from slimectl.starter_models.tiny_vlms import build_tiny_vlm

    model = build_tiny_vlm("qwen2_5-vl", tmp_path / "model")
    (tmp_path / "red.png").write_bytes(_png("red", (56, 56)))
    (tmp_path / "blue.png").write_bytes(_png("blue", (56, 56)))
    red, blue = (decode_image(f"{c}.png", tmp_path, "t") for c in ("red", "blue"))
    run = init_run(tmp_path / "run", overrides=[f"model.path={model}", f"rollout.n_samples_per_prompt={N}",
                                                  "rollout.batch_size=1"]).run
    store_images(run.path, [red])
    proc = load_processor(model)
    start, end = proc.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    pad = proc.image_token_id

    def traj(i: int, image, group: int | None = None) -> dict:
        d = {"index": i, "tokens": [5, start, pad, pad, pad, pad, end, 6, 7 + i, 8], "response_length": 2,
             "reward": float(i % 2), "rollout_log_probs": [-0.5, -1.0], "loss_mask": [1, 1],
             "multimodal_inputs": {"image": [image.sha256]}}
        return d if group is None else {**d, "group_index": group}

    return {"run": run, "red": red, "blue": blue, "traj": traj}


@pytest.fixture
def buffers(tmp_path):
    started: list[Buffer] = []
    yield lambda name, *args: started.append(Buffer(tmp_path / name, *args)) or started[-1]
    for b in started:
        b.stop()


def test_a_buffer_served_for_a_vlm_run_refuses_a_trajectory_whose_image_is_not_in_the_run(vlm_run, buffers):
    from slimectl.stages.rollout.buffer_source import collect_rollout

    run, traj, red, blue = vlm_run["run"], vlm_run["traj"], vlm_run["red"], vlm_run["blue"]
    buf = buffers("buffer", "-r", str(run.path))
    t = buf.ok("POST", "/tasks", {})
    status, out = buf.call("POST", f"/tasks/{t['task_id']}/trajectories",
                           {"trajectories": [traj(0, red), traj(1, blue)]})  # all or none: the red one is not kept
    assert status == 400, out
    message = out["message"]
    assert message.startswith(f"trajectory 1: its image {blue.sha256} is not in the run's media/") and "\n" not in message
    stats = buf.stats()
    assert stats["rejected"]["by_reason"] == {"invalid_trajectory": 1}
    assert stats["trajectories"]["received"] == stats["trajectories"]["buffered"] == 0 and stats["groups"]["ready"] == 0
    # the run's own images pass, and the collected rollout keeps their references
    for i in range(N):
        buf.ok("POST", f"/tasks/{t['task_id']}/trajectories", traj(i, red))
    result = collect_rollout(run, run.config(), buf.url)
    samples = read_samples(run.rollouts.get(result.rollout_id, verify="full").file(SAMPLES_FILE))
    assert [s.multimodal_inputs for s in samples] == [{"image": [red.sha256]}] * N


def test_collecting_a_vlm_trajectory_whose_image_is_missing_is_one_line_and_nothing_is_published(vlm_run, buffers):
    from slimectl.stages.rollout.buffer_source import collect_rollout

    run, traj, red, blue = vlm_run["run"], vlm_run["traj"], vlm_run["red"], vlm_run["blue"]
    buf = buffers("plain")  # no run: the service cannot see RUN/media and takes the trajectory
    buf.ok("POST", "/buffer/write", {"trajectories": [traj(i, blue if i == 2 else red, group=0) for i in range(N)]})
    with pytest.raises(UsageError) as exc:
        collect_rollout(run, run.config(), buf.url)
    message = str(exc.value)
    assert exc.value.exit_code == 2 and "\n" not in message
    assert message.startswith(f"buffer sample 2 (group 0): its image {blue.sha256} is not in the run's media/")
    assert "serve the buffer with -r RUN" in message
    assert run.rollouts.ids() == []
    stats = buf.stats()  # the lease was released: the group is ready again, not lost
    assert stats["groups"]["ready"] == 1 and stats["groups"]["leased"] == 0 and stats["groups"]["acked"] == 0
