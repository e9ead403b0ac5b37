"""bench/learn_vs_trl.py — does a real model learn as fast with `slimectl rl` as with TRL's GRPOTrainer?

Both sides get the same task (``examples/real_model/addition.py``: "What is a + b?" for single digits,
70 training pairs, 30 held out), the same chat template and system prompt, sampling temperature, group
size (``--samples``), prompts per step (``--prompts``), completion cap (``--new-tokens``), learning
rate (constant, no warm-up), no KL, one optimizer step per rollout and the same reward function
(``addition.score``: slimectl calls it as the custom reward ``addition:reward``, TRL as
``addition.trl_reward``). Everything else is each tool's default. Each side gets the same wall-clock
budget (``--budget-min``, counted from the launch of its process: start-up is part of what a user
waits for) and runs back to back with the other, alone on the machine.

A side stops when its next step could end after the budget (the bench predicts it with a margin:
1.5 times the longest of its last 5 steps, since step times jitter; slimectl gets SIGTERM between two
steps, TRL's trainer is told to stop), so the model a side ends with is the one of its last step
finished within the budget. That model (slimectl: the newest
``weights/N``; TRL: ``save_model``) and the base model are scored on the held-out prompts by the same
code (:func:`evaluate`: HF ``generate``, greedy and ``--eval-samples`` samples at the training
temperature; pass@1 is the share of correct answers).

Prints, per side, the steps done, the mean reward in each minute of wall time (the reward of the
steps that ended in that minute), the correct samples per minute and the held-out pass@1 before and
after; writes ``--out/learn_vs_trl.png`` (both reward curves against wall time) and
``--out/learn_vs_trl.json``.

    python bench/learn_vs_trl.py --model ~/.cache/slimectl/models/smollm2-135m-instruct --trl-python VENV/bin/python
    python bench/learn_vs_trl.py --tiny-model --budget-min 0.5 --no-trl       # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "examples" / "real_model"
sys.path.insert(0, str(TASK))
import addition  # noqa: E402  (examples/real_model/addition.py: the task and its reward)


# ----------------------------------------------------------------------------- the held-out evaluation
def evaluate(model_dir: Path, tokenizer_dir: Path, rows: list[dict], samples: int, temperature: float,
             new_tokens: int, seed: int) -> dict:
    """Held-out pass@1 of ``model_dir``: greedy, and over ``samples`` samples per prompt at ``temperature``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    texts = [tok.apply_chat_template(r["input"], tokenize=False, add_generation_prompt=True)
             if tok.chat_template else "\n".join(m["content"] for m in r["input"]) + "\n" for r in rows]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    labels = [r["label"] for r in rows]

    def scores(out, k: int) -> list[float]:
        texts_out = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return [addition.score(t, labels[i // k]) for i, t in enumerate(texts_out)]

    torch.manual_seed(seed)
    with torch.no_grad():
        greedy = model.generate(**enc, do_sample=False, max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id)
        sampled = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=new_tokens, num_return_sequences=samples,
                                 pad_token_id=tok.pad_token_id)
    g, s = scores(greedy, 1), scores(sampled, samples)
    return {"greedy": sum(g) / len(g), "sampled": sum(s) / len(s), "prompts": len(rows), "samples": samples}


# ----------------------------------------------------------------------------- the budget
STEP_MARGIN, RECENT_STEPS = 1.5, 5  # the next step is predicted as 1.5x the longest of the last 5


def next_step_overruns(started: float, now: float, step_times: list[float], budget_s: float) -> bool:
    """Whether the next step, started now, could end after the budget.

    Step times jitter (a step is not as long as the one before it), so the prediction is
    ``STEP_MARGIN`` times the longest of the last ``RECENT_STEPS`` steps.
    """
    predicted = STEP_MARGIN * max(step_times[-RECENT_STEPS:], default=0.0)
    return now - started + predicted > budget_s


# ----------------------------------------------------------------------------- slimectl rl
def slimectl_config(work: Path, model: Path, a, seed: int) -> Path:
    import yaml

    cfg = {"name": "learn-vs-trl", "model": {"path": str(model)},
           "data": {"prompt_data": str(TASK / "train.jsonl"), "input_key": "input", "label_key": "label",
                    "seed": seed},
           "rollout": {"num_rollout": 100_000, "batch_size": a.prompts, "n_samples_per_prompt": a.samples,
                       "max_response_len": a.new_tokens, "temperature": a.temperature,
                       "reward": "addition:reward", "seed": seed},
           "train": {"lr": a.lr, "lr_decay_style": "constant", "use_rollout_logprobs": True,
                     "max_tokens_per_micro_batch": 4096, "save_interval": 100_000},
           "sync": {"transport": "disk"},
           "logging": {"tensorboard": False}}
    path = work / "rl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_slimectl(work: Path, model: Path, a, seed: int) -> dict:
    """`slimectl rl` until its next step would overrun the budget; its curve and its newest weights."""
    from slimectl.contract.metrics import read_metrics
    from slimectl.contract.rundir import RunDir

    run_path = work / f"slimectl-{seed}"
    argv = [sys.executable, "-m", "slimectl", "rl", "-c", str(slimectl_config(work, model, a, seed)),
            "-r", str(run_path), *(x for kv in a.set for x in ("--set", kv))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(TASK), str(ROOT), os.environ.get("PYTHONPATH"))
                                                       if p)}
    log = (work / f"slimectl-{seed}.log").open("w")
    started = time.time()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    budget, metrics = a.budget_min * 60, run_path / "metrics" / "rl.jsonl"
    while proc.poll() is None:
        recs = read_metrics(metrics)  # (a torn last line, still being written, is skipped)
        step_times = [r["perf/rl_step_time"] for r in recs[-RECENT_STEPS:]]
        if next_step_overruns(started, time.time(), step_times, budget):
            proc.send_signal(signal.SIGTERM)  # between two steps: nothing of a finished step is lost
            break
        time.sleep(0.2)
    stopped = time.time() - started
    proc.wait()
    log.close()
    recs = read_metrics(metrics)
    if not recs:
        sys.exit(f"slimectl rl made no step in the budget; its log: {work / f'slimectl-{seed}.log'}")
    # The weights of the curve's last step: a step the signal ended after its weights/N but before its metrics
    # line was not in the curve, so its weights are not the side's result either (weights/N = N steps trained).
    weights = RunDir(run_path).weights
    final = weights.get(len(recs)) if weights.exists(len(recs)) else weights.latest()
    return {"curve": [(r["time"] - started, r["rl/reward_mean"]) for r in recs], "stopped_s": stopped,
            "steps": len(recs), "model": str(final.path), "weight_version": final.id}


# ----------------------------------------------------------------------------- TRL (a worker process)
def trl_worker(spec: dict) -> None:
    """Runs under the interpreter that has TRL; prints RESULT {json}."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    started = spec["started"]
    torch.manual_seed(spec["seed"])
    rows = [{"prompt": r["input"], "label": r["label"]} for r in addition.train_rows()]
    args = GRPOConfig(
        output_dir=spec["out"], use_cpu=True, bf16=False, gradient_checkpointing=False, lr_scheduler_type="constant",
        warmup_steps=0, learning_rate=spec["lr"], max_completion_length=spec["new_tokens"],
        temperature=spec["temperature"], top_k=0, top_p=1.0, beta=0.0, use_vllm=False, report_to="none",
        num_generations=spec["samples"], per_device_train_batch_size=spec["prompts"] * spec["samples"],
        gradient_accumulation_steps=1, max_steps=100_000, logging_steps=1, save_strategy="no", seed=spec["seed"],
        num_iterations=1)
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=addition.trl_reward, args=args,
                          train_dataset=Dataset.from_list(rows))
    curve: list[tuple[float, float]] = []

    class Budget(TrainerCallback):
        def __init__(self):
            self.t, self.step_times = time.time(), []

        def on_log(self, _args, state, control, logs=None, **_):
            if logs and "reward" in logs:
                curve.append((time.time() - started, float(logs["reward"])))

        def on_step_end(self, _args, state, control, **_):
            now = time.time()
            self.step_times.append(now - self.t)
            self.t = now
            if next_step_overruns(started, now, self.step_times, spec["budget_s"]):
                control.should_training_stop = True

    trainer.add_callback(Budget())
    trainer.train()
    stopped = time.time() - started
    trainer.save_model(spec["out"])
    print("RESULT " + json.dumps({"curve": curve, "stopped_s": stopped, "steps": trainer.state.global_step}),
          flush=True)


def run_trl(work: Path, model: Path, a, seed: int) -> dict:
    out = work / f"trl-{seed}"
    spec = {"model": str(model), "prompts": a.prompts, "samples": a.samples, "new_tokens": a.new_tokens,
            "temperature": a.temperature, "lr": a.lr, "seed": seed, "budget_s": a.budget_min * 60, "out": str(out)}
    env = {**os.environ, "PYTHONPATH": ":".join(p for p in (a.trl_pythonpath, os.environ.get("PYTHONPATH")) if p)}
    spec["started"] = time.time()
    proc = subprocess.run([a.trl_python, __file__, "--trl-worker", json.dumps(spec)], capture_output=True,
                          text=True, env=env)
    (work / f"trl-{seed}.log").write_text(proc.stdout + proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"TRL failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return {**json.loads(lines[-1][len("RESULT "):]), "model": str(out)}


# ----------------------------------------------------------------------------- figures
def per_minute(curve: list[tuple[float, float]], minutes: int) -> list[float | None]:
    """The mean reward of the steps that ended in each minute of wall time (None: no step ended in it)."""
    bins: list[list[float]] = [[] for _ in range(minutes)]
    for t, r in curve:
        if 0 <= t < minutes * 60:
            bins[int(t // 60)].append(r)
    return [sum(b) / len(b) if b else None for b in bins]


SMOOTH = 8  # steps in the plotted moving mean


def smoothed(curve: list[tuple[float, float]], window: int) -> list[tuple[float, float]]:
    out = []
    for i in range(len(curve)):
        part = curve[max(0, i - window + 1):i + 1]
        out.append((curve[i][0], sum(r for _, r in part) / len(part)))
    return out


def plot(results: dict, base: dict, path: Path, budget_min: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {"slimectl rl": "tab:blue", "TRL GRPOTrainer": "tab:orange"}
    for side, runs in results.items():
        for i, res in enumerate(runs):
            raw = [(t / 60, r) for t, r in res["curve"]]
            ax.scatter([t for t, _ in raw], [r for _, r in raw], s=6, alpha=0.25, color=colors[side])
            line = smoothed(res["curve"], SMOOTH)
            ax.plot([t / 60 for t, _ in line], [r for _, r in line],
                    color=colors[side], linestyle="-" if i == 0 else "--",
                    label=f"{side} (seed {res['seed']}: {res['steps']} steps, held-out pass@1 "
                          f"{base['sampled']:.2f} -> {res['eval']['sampled']:.2f})")
    ax.set_xlim(0, budget_min)
    ax.set_xlabel("wall time since launch (min)")
    ax.set_ylabel(f"reward per step (mean of {SMOOTH} steps)")
    ax.set_title("SmolLM2 learns a + b: slimectl rl vs TRL, same task, reward and budget")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results: dict, base: dict, a) -> None:
    minutes = max(1, math.ceil(a.budget_min))
    print(f"held-out pass@1 of the base model: {base['sampled']:.3f} sampled "
          f"({base['prompts']} prompts x {base['samples']} at T={a.temperature}), {base['greedy']:.3f} greedy")
    for side, runs in results.items():
        for i, res in enumerate(runs):
            pm = per_minute(res["curve"], minutes)
            correct = a.prompts * a.samples * sum(r for _, r in res["curve"]) / (res["stopped_s"] / 60)
            print(f"{side:>16} seed {res['seed']}: {res['steps']} steps in {res['stopped_s'] / 60:.1f} min, "
                  f"{correct:.1f} correct samples/min; held-out pass@1 {res['eval']['sampled']:.3f} sampled, "
                  f"{res['eval']['greedy']:.3f} greedy")
            print(" " * 17 + "reward by minute: " + " ".join("  -  " if v is None else f"{v:.2f}" for v in pm))


# ----------------------------------------------------------------------------- main
def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--trl-worker":
        return trl_worker(json.loads(sys.argv[2]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="HF model directory (SmolLM2-135M-Instruct: slimectl init --pretrained)")
    ap.add_argument("--tiny-model", action="store_true", help="a tiny random qwen2 instead (smoke run)")
    ap.add_argument("--budget-min", type=float, default=15.0, help="wall-clock minutes per side and round")
    ap.add_argument("--rounds", type=int, default=1, help="slimectl then TRL, this many times (seeds --seed, --seed + 1, ...)")
    ap.add_argument("--seed", type=int, default=0, help="the first round's seed (data order, sampling, TRL's)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--samples", type=int, default=4, help="completions per prompt (the group)")
    ap.add_argument("--new-tokens", type=int, default=24, help="completion cap")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--eval-samples", type=int, default=8, help="samples per held-out prompt")
    ap.add_argument("--out", type=Path, default=None, help="folder for the PNG and JSON (default: the work folder)")
    ap.add_argument("--trl-python", default=sys.executable, help="interpreter with trl installed")
    ap.add_argument("--trl-pythonpath", default="", help="prepended to the TRL worker's PYTHONPATH")
    ap.add_argument("--no-trl", action="store_true", help="slimectl's side only (where TRL is not installed)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for slimectl's side (repeatable)")
    a = ap.parse_args()
    if (a.model is None) == (not a.tiny_model):
        ap.error("give --model DIR or --tiny-model")
    if a.model is not None and not (a.model / "config.json").is_file():
        ap.error(f"--model {a.model}: no config.json there; give an HF model folder "
                 "(slimectl init --pretrained smollm2-135m builds SmolLM2's)")
    work = Path(tempfile.mkdtemp(prefix="learn_vs_trl_"))
    out = a.out or work
    out.mkdir(parents=True, exist_ok=True)
    model = a.model
    if a.tiny_model:
        from slimectl.starter_models.tiny_models import build_tiny_model

        model = build_tiny_model("qwen2", work / "tiny-qwen2", seed=0)
    held_out = addition.held_out_rows()

    def score(path) -> dict:
        return evaluate(Path(path), model, held_out, a.eval_samples, a.temperature, a.new_tokens, seed=1234)

    base = score(model)
    results: dict[str, list[dict]] = {"slimectl rl": [], "TRL GRPOTrainer": []}
    for seed in range(a.seed, a.seed + a.rounds):
        res = run_slimectl(work, model, a, seed)
        results["slimectl rl"].append({**res, "seed": seed, "eval": score(res["model"])})
        if not a.no_trl:
            res = run_trl(work, model, a, seed)
            results["TRL GRPOTrainer"].append({**res, "seed": seed, "eval": score(res["model"])})
    results = {k: v for k, v in results.items() if v}
    print(f"model {model}: {a.prompts} prompts x {a.samples} samples x <= {a.new_tokens} tokens, T={a.temperature}, "
          f"lr {a.lr}, budget {a.budget_min:g} min per side, {a.rounds} round(s) from seed {a.seed}; work in {work}")
    report(results, base, a)
    plot(results, base, out / "learn_vs_trl.png", a.budget_min)
    (out / "learn_vs_trl.json").write_text(json.dumps({"base": base, "results": results,
                                                       "args": {k: str(v) for k, v in vars(a).items()}}, indent=1))
    print(f"wrote {out / 'learn_vs_trl.png'} and {out / 'learn_vs_trl.json'}")


if __name__ == "__main__":
    main()
