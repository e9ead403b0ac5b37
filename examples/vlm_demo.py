"""The VLM CPU demo: a tiny offline Qwen2.5-VL names the colour of a square, SFT warm start then GRPO.

    python examples/vlm_demo.py [RUN_DIR] [--seed N] [--sft-steps N] [--set KEY=VALUE ...] [--dry-run]
                                                            (default: runs/vlm-demo)
    python examples/vlm_demo.py --write-data [FILE]          (default: examples/data/vlm_colours.parquet)

The task (examples/data/vlm_colours.parquet, written by :func:`write_dataset`): a 56 x 56 image, a light grey
background with one square of 16-32 px in one of four colours (:data:`COLOURS`), and the question "What colour is
the square? Answer with one word."; the label is the colour's name. 256 rows, 64 per colour, the images as PNG bytes
in a Parquet binary column (``data.multimodal_keys: {image: image}``). The reward (:func:`reward`,
``rollout.reward: vlm_demo:reward``, this folder on PYTHONPATH) is 1.0 when the answer is exactly the colour's name
(case, spaces and a final full stop aside), else 0.0: chance is 0.25 once the model answers with colour names.

1. ``slimectl init RUN-warmstart``  the tiny offline Qwen2.5-VL (examples/vlm_sft_warmstart.yaml)
2. SFT samples (each prompt with its image, answered by its label) published as that run's rollouts
3. ``slimectl train -r RUN-warmstart``  SFT steps (algorithm.loss_type = sft_loss; --sft-steps)
4. ``slimectl rl --config examples/vlm_demo.yaml -r RUN``  GRPO from the warm start: the embedded engine,
   rollout -> train -> disk sync, eval with pass@k (--set KEY=VALUE overrides a key of vlm_demo.yaml)
5. ``slimectl plot -r RUN``  the reward curve, and RUN/plots/curves.png

Rerunning resumes every step from its run directory. --dry-run prints the resolved configs of the warm start and of
the RL run (``slimectl init/rl --dry-run``) and writes nothing.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA_FILE = HERE / "data" / "vlm_colours.parquet"
TINY_MODEL = "qwen2_5-vl"

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 40)}
"""The four answers and the RGB of their squares."""
QUESTION = "What colour is the square? Answer with one word."
IMAGE_SIZE = 56  # 56 x 56 px: 2 x 2 merged patches of the tiny Qwen2.5-VL, i.e. 4 image tokens
NUM_ROWS = 256


# ----------------------------------------------------------------------------------------- the data

def make_image(colour: str, rng: random.Random) -> bytes:
    """PNG bytes: a light grey background (its shade drawn from ``rng``) with one ``colour`` square of 16-32 px
    at a random place."""
    from PIL import Image, ImageDraw

    grey = rng.randint(215, 245)
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (grey, grey, grey))
    side = rng.randint(16, 32)
    x, y = rng.randint(0, IMAGE_SIZE - side), rng.randint(0, IMAGE_SIZE - side)
    ImageDraw.Draw(img).rectangle((x, y, x + side - 1, y + side - 1), fill=COLOURS[colour])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def make_rows(n: int = NUM_ROWS, seed: int = 0) -> list[dict]:
    """``n`` rows ``{"input", "label", "image"}``, the colours balanced (``n / 4`` each) and shuffled by ``seed``."""
    if n % len(COLOURS):
        raise ValueError(f"{n} rows cannot hold the {len(COLOURS)} colours equally")
    rng = random.Random(seed)
    labels = [c for c in COLOURS for _ in range(n // len(COLOURS))]
    rng.shuffle(labels)
    return [{"input": QUESTION, "label": c, "image": make_image(c, rng)} for c in labels]


def write_dataset(path: str | Path = DATA_FILE, n: int = NUM_ROWS, seed: int = 0) -> Path:
    """The rows of :func:`make_rows` as Parquet (the image a binary column), through a temp file and a rename."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = make_rows(n, seed)
    table = pa.table({"input": pa.array([r["input"] for r in rows], pa.string()),
                      "label": pa.array([r["label"] for r in rows], pa.string()),
                      "image": pa.array([r["image"] for r in rows], pa.binary())})
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------------------- the reward

_SPECIAL = re.compile(r"<\|[^|<>]*\|>")


def answer_word(response: str | None) -> str:
    """The answer as graded: special tokens (``<|im_end|>``...) dropped, lower case, outer spaces and one final
    full stop removed."""
    text = _SPECIAL.sub("", response or "").strip().lower()
    return text[:-1].rstrip() if text.endswith(".") else text


def grade(response: str | None, label: str) -> float:
    """1.0 when the response is exactly the label's word (see :func:`answer_word`), else 0.0."""
    return 1.0 if answer_word(response) == str(label).strip().lower() else 0.0


async def reward(args, sample) -> float:
    """slimectl's custom reward (``rollout.reward: vlm_demo:reward``)."""
    return grade(sample.response, sample.label)


# ----------------------------------------------------------------------------------------- the steps

def slimectl_command() -> list[str]:
    from cpu_demo import slimectl_command as command  # $SLIMECTL, else python -m slimectl

    return command()


def _env() -> dict[str, str]:
    """Subprocess environment: ``vlm_demo:reward`` importable (this folder on PYTHONPATH)."""
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def slimectl(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    if "--dry-run" in args and not capture:
        print("---", flush=True)  # stdout: one YAML document per resolved config
    print(f"$ slimectl {' '.join(args)}", file=sys.stderr, flush=True)
    proc = subprocess.run([*slimectl_command(), *args], env=_env(), capture_output=capture, text=True)
    if proc.returncode != 0 and not capture:
        sys.exit(f"slimectl {args[0]} failed with exit code {proc.returncode}")
    return proc


def sft_samples(run, rows, rid: int, batch_size: int, rng: random.Random, tok) -> list:
    """One SFT batch: rows drawn by ``rng``, each its prompt ids (images expanded) + its label + eos, every
    response token trained, its images referenced (``multimodal_inputs``)."""
    from slimectl.contract.samples import Sample, Status
    from slimectl.stages.rollout.media import image_refs, store_images

    samples = []
    for i in range(batch_size):
        row = rng.choice(rows)
        store_images(run.path, row.images)
        answer = tok.encode(str(row.label), add_special_tokens=False) + [tok.eos_token_id]
        s = Sample(group_index=i, index=i, rollout_id=rid, prompt=row.prompt_text, tokens=list(row.prompt_ids),
                   label=str(row.label), multimodal_inputs=image_refs(row.images))
        s.append_response_tokens(answer, [0.0] * len(answer), True, {"weight_version": "sft"})
        s.response = tok.decode(answer, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        s.status, s.reward = Status.COMPLETED, 1.0
        samples.append(s)
    return samples


def publish_sft_rollouts(run_path: str | Path, seed: int) -> None:
    """The warm start's SFT batches, one per rollout id, published as rollouts (as examples/cpu_demo.py does)."""
    from slimectl.contract.rundir import RunDir
    from slimectl.contract.samples import SAMPLES_FILE, write_samples
    from slimectl.stages.rollout.prompts import prepared_prompts

    run = RunDir.open(run_path)
    cfg = run.config()
    rows, _, _, tok = prepared_prompts(cfg, None)  # through the VLM's processor: what the engine would see
    rng = random.Random(seed)
    for rid in range(cfg.rollout.num_rollout):
        samples = sft_samples(run, rows, rid, cfg.rollout.batch_size, rng, tok)  # drawn even if published: same data
        if run.rollouts.exists(rid):
            continue
        with run.rollouts.publish(rid, meta={"weight_version": "0", "kind": "sft"}, stage="sft-data") as d:
            write_samples(samples, d / SAMPLES_FILE)


def _start_path(warm: str, sft_steps: int | None, dry_run: bool) -> str:
    """Where the warm start's last weights are (a dry run: would be)."""
    if dry_run:
        import yaml

        from slimectl.contract.rundir.artifacts import format_id

        steps = sft_steps or yaml.safe_load((HERE / "vlm_sft_warmstart.yaml").read_text())["rollout"]["num_rollout"]
        return str(Path(warm) / "weights" / format_id(steps))
    from slimectl.contract.rundir import RunDir

    return str(RunDir.open(warm).weights.latest().path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", default="runs/vlm-demo")
    ap.add_argument("--seed", type=int, default=0, help="seed of the SFT data, the model and the RL run")
    ap.add_argument("--sft-steps", type=int, default=None,
                    help="SFT steps of the warm start (default: vlm_sft_warmstart.yaml's rollout.num_rollout)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a key of vlm_demo.yaml for the RL run, e.g. rollout.num_rollout=60")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the resolved warm-start and RL configs and exit without doing anything")
    ap.add_argument("--write-data", nargs="?", const=str(DATA_FILE), metavar="FILE",
                    help=f"write the task's dataset to FILE (default {DATA_FILE.relative_to(HERE.parent)}) and exit")
    a = ap.parse_args()
    if a.write_data:
        print(write_dataset(a.write_data))
        return
    if a.sft_steps is not None and a.sft_steps < 1:
        ap.error(f"--sft-steps ({a.sft_steps}) must be >= 1")
    warm = f"{a.run}-warmstart"
    sft = [] if a.sft_steps is None else ["--set", f"rollout.num_rollout={a.sft_steps}",
                                          "--set", f"train.save_interval={a.sft_steps}"]
    dry = ["--dry-run"] if a.dry_run else []
    slimectl("init", warm, "--config", str(HERE / "vlm_sft_warmstart.yaml"), "--tiny-model", TINY_MODEL,
             "--set", f"train.seed={1234 + a.seed}", *sft, *dry)
    if not a.dry_run:
        publish_sft_rollouts(warm, a.seed)
        slimectl("train", "-r", warm, "--allow-empty")
    slimectl("rl", "--config", str(HERE / "vlm_demo.yaml"), "-r", a.run,
             "--set", f"model.path={_start_path(warm, a.sft_steps, a.dry_run)}",
             "--set", f"rollout.seed={42 + a.seed}", "--set", f"data.seed={42 + a.seed}",
             "--set", f"train.seed={1234 + a.seed}", *(x for o in a.overrides for x in ("--set", o)), *dry)
    if not a.dry_run:
        slimectl("plot", "-r", a.run)


if __name__ == "__main__":
    main()
