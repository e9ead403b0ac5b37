"""bench/rl_vs_trl.py — `slimectl rl` vs TRL's GRPOTrainer on the same work, interleaved (A B A B).

Same model, prompts ("What is a+b?", chat template when the tokenizer has one), batch shape
(``--prompts`` x ``--samples`` completions per optimizer step), completion length (``--new-tokens``,
no EOS stop on neither side's cap), learning rate, no KL / reference model, one optimizer step per
rollout, random reward on both sides (timing does not depend on it). TRL is configured as
``../shared/reference/trl-baseline.md`` says (its defaults are GPU-tuned): ``use_cpu``, no bf16, no
gradient checkpointing, constant LR, ``beta=0``, ``num_iterations=1``, one micro-batch.

Per side it prints the median step time (first ``--warmup`` steps dropped) with its phase split
(slimectl: rollout / train / sync from ``metrics/rl.jsonl``, the trainer's ``perf/`` phases from
``metrics/train.jsonl``; TRL: ``generate`` and the rest of the step), peak RSS per process and of
the whole process tree (sampled with psutil), completion tokens/s, and the ratio rl / TRL.

TRL is not a slimectl dependency: install it where ``--trl-python`` (default: this interpreter)
finds it — ``pip install 'slimectl[bench]'`` or a venv of its own (``--trl-pythonpath`` adds a
directory to its ``PYTHONPATH``).

    python bench/rl_vs_trl.py --model DIR [--rounds 2] [--steps 6] [--prompts 4] [--samples 4] [--new-tokens 32]
    python bench/rl_vs_trl.py --tiny-model          # a smoke run on a tiny random qwen2
    python bench/rl_vs_trl.py --model DIR --no-trl --set sync.transport=distributed   # slimectl alone, a setting changed
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- process-tree memory
class TreeRSS:
    """Peak RSS of a process and its children (per process and of the tree), sampled every 50 ms."""

    def __init__(self, pid: int):
        import psutil

        self.proc = psutil.Process(pid)
        self.per_proc: dict[str, int] = {}
        self.tree = self.root = 0  # (root: the process itself, without its children)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            total = 0
            try:
                procs = [self.proc] + self.proc.children(recursive=True)
            except psutil.NoSuchProcess:
                break
            for p in procs:
                try:
                    rss = p.memory_info().rss
                    name = " ".join(p.cmdline()[1:4])[:60] or p.name()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                total += rss
                if p.pid == self.proc.pid:
                    self.root = max(self.root, rss)
                key = f"{p.pid} {name}"
                self.per_proc[key] = max(self.per_proc.get(key, 0), rss)
            self.tree = max(self.tree, total)
            self._stop.wait(0.05)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        top = sorted(self.per_proc.items(), key=lambda kv: -kv[1])[:3]
        return {"tree_gb": self.tree / 2**30, "root_gb": self.root / 2**30, "per_process_gb": {k: v / 2**30 for k, v in top}}


def prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        out.append({"input": f"What is {a}+{b}?", "label": str(a + b)})
    return out


def has_chat_template(model: Path) -> bool:
    cfg = model / "tokenizer_config.json"
    return (model / "chat_template.jinja").exists() or (cfg.exists() and "chat_template" in json.loads(cfg.read_text()))


def add_work_args(ap: argparse.ArgumentParser, rounds: tuple[int, str], steps: int, warmup: int) -> None:
    """The options of the work a bench gives each side: the model, the rounds, the steps and the batch shape."""
    ap.add_argument("--model", type=Path, help="HF model directory (e.g. SmolLM2-135M-Instruct)")
    ap.add_argument("--tiny-model", action="store_true", help="a tiny random qwen2 instead (smoke run)")
    ap.add_argument("--rounds", type=int, default=rounds[0], help=rounds[1])
    ap.add_argument("--steps", type=int, default=steps, help="optimizer steps (rollouts) per run")
    ap.add_argument("--warmup", type=int, default=warmup, help="steps dropped from each run's figures")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-6)


# ----------------------------------------------------------------------------- slimectl rl
def rl_argv(config: Path, run: Path, sets: list[str]) -> list[str]:
    """The `slimectl rl` command of one run: the bench's config, then each ``--set KEY=VALUE`` given."""
    return [sys.executable, "-m", "slimectl", "rl", "-c", str(config), "-r", str(run),
            *(x for kv in sets for x in ("--set", kv))]


def run_rl_watched(config: Path, run: Path, sets: list[str], what: str) -> dict:
    """Run `slimectl rl` (:func:`rl_argv`) to the end with its process tree's peak RSS sampled; exits on failure."""
    proc = subprocess.Popen(rl_argv(config, run, sets), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"})
    mem = TreeRSS(proc.pid)
    out, _ = proc.communicate()
    memory = mem.stop()
    if proc.returncode != 0:
        sys.exit(f"{what} failed ({proc.returncode}):\n{out[-3000:]}")
    return memory


def run_slimectl(work: Path, model: Path, a, seed: int, sets: list[str] | None = None) -> dict:
    """slimectl's side of one round (``sets``: overrides on top of ``a.set``); its figures and memory."""
    import yaml

    data = work / "prompts.jsonl"
    rows = prompts(a.prompts * (a.steps + 1), seed)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"name": "rl-vs-trl", "model": {"path": str(model)},
           "data": {"prompt_data": str(data), "apply_chat_template": has_chat_template(model), "shuffle": False},
           "rollout": {"num_rollout": a.steps, "batch_size": a.prompts, "n_samples_per_prompt": a.samples,
                       "max_response_len": a.new_tokens, "temperature": 1.0, "reward": "random", "seed": seed},
           "train": {"lr": a.lr, "lr_decay_style": "constant", **({"max_tokens_per_micro_batch": a.micro_batch}
                                                                  if a.micro_batch else {})},
           "logging": {"tensorboard": False},
           **({"engine": {"offload_during_train": True}} if a.offload else {})}
    path = work / "rl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = work / f"run-{seed}"
    memory = run_rl_watched(path, run, a.set + list(sets or []), "slimectl rl")
    rl = [json.loads(x) for x in (run / "metrics" / "rl.jsonl").read_text().splitlines()][a.warmup:]
    train = [json.loads(x) for x in (run / "metrics" / "train.jsonl").read_text().splitlines()][a.warmup:]

    def med(recs, key):
        vals = [r[key] for r in recs if key in r]
        return statistics.median(vals) if vals else None

    step = med(rl, "perf/rl_step_time")
    phases = {"rollout": med(rl, "perf/rl_rollout_wait_time"), "train": med(rl, "perf/rl_train_time"),
              "sync": med(rl, "perf/rl_sync_time")}
    phases.update({k.split("/")[1]: med(train, k) for k in ("perf/log_probs_time", "perf/actor_train_time",
                                                           "perf/save_time", "perf/update_weights_time")})
    return {"step_s": step, "phases_s": phases, "tokens_per_s": a.prompts * a.samples * a.new_tokens / step,
            "run": str(run), **memory}


# ----------------------------------------------------------------------------- TRL (a worker process)
def trl_worker(spec: dict) -> None:
    """Runs under the interpreter that has TRL; prints RESULT {json}."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(spec["seed"])
    chat = spec["chat"]
    rows = [{"prompt": [{"role": "user", "content": r["input"]}] if chat else r["input"]} for r in spec["prompts"]]
    rng = random.Random(spec["seed"])

    def reward(completions, **_):
        return [float(rng.random() < 0.5) for _ in completions]

    n = spec["prompts_per_step"] * spec["samples"]
    args = GRPOConfig(
        output_dir=spec["out"], use_cpu=True, bf16=False, gradient_checkpointing=False, lr_scheduler_type="constant",
        learning_rate=spec["lr"], max_completion_length=spec["new_tokens"], temperature=1.0, top_k=0, top_p=1.0,
        beta=0.0, use_vllm=False, report_to="none", num_generations=spec["samples"], per_device_train_batch_size=n,
        gradient_accumulation_steps=1, max_steps=spec["steps"], logging_steps=1, save_strategy="no", seed=spec["seed"],
        num_iterations=1)
    peft_config = None
    if spec.get("lora"):  # bench/lora.py: a PEFT LoRA of the same rank (peft installed next to trl)
        from peft import LoraConfig

        peft_config = LoraConfig(r=spec["lora"]["rank"], lora_alpha=spec["lora"]["alpha"], target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          peft_config=peft_config)
    gen = {"s": 0.0}
    model = trainer.model
    original = model.generate

    def timed_generate(*a, **k):
        t = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            gen["s"] += time.perf_counter() - t

    model.generate = timed_generate
    steps: list[dict] = []

    class Clock(TrainerCallback):
        def __init__(self):
            self.t = time.perf_counter()

        def on_step_end(self, *_, **__):
            now = time.perf_counter()
            steps.append({"step_s": now - self.t, "generate_s": gen["s"]})
            gen["s"] = 0.0
            self.t = now

    trainer.add_callback(Clock())
    trainer.train()
    print("RESULT " + json.dumps(steps), flush=True)


def run_trl(work: Path, model: Path, a, seed: int, lora: dict | None = None) -> dict:
    """TRL's side of one round (``lora``: {rank, alpha}: a PEFT LoRA instead of full training)."""
    spec = {"model": str(model), "prompts": prompts(a.prompts * a.steps, seed), "prompts_per_step": a.prompts,
            "samples": a.samples, "new_tokens": a.new_tokens, "lr": a.lr, "steps": a.steps, "seed": seed,
            "chat": has_chat_template(model), "out": str(work / f"trl-{seed}"), "lora": lora}
    env = {**os.environ, "PYTHONPATH": ":".join(p for p in (a.trl_pythonpath, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([a.trl_python, __file__, "--trl-worker", json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    mem = TreeRSS(proc.pid)
    out, _ = proc.communicate()
    memory = mem.stop()
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"TRL failed ({proc.returncode}):\n{out[-3000:]}")
    steps = json.loads(lines[-1][len("RESULT "):])[a.warmup:]
    step = statistics.median(s["step_s"] for s in steps)
    generate = statistics.median(s["generate_s"] for s in steps)
    return {"step_s": step, "phases_s": {"generate": generate, "loss+backward+optimizer": step - generate},
            "tokens_per_s": a.prompts * a.samples * a.new_tokens / step, **memory}


def count_params(model: Path) -> int:
    """Parameters in the model's safetensors files (headers only)."""
    from safetensors import safe_open

    n = 0
    for f in Path(model).glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                size = 1
                for x in fh.get_slice(k).get_shape():
                    size *= x
                n += size
    return n


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--trl-worker":
        return trl_worker(json.loads(sys.argv[2]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_work_args(ap, rounds=(2, "A B pairs (interleaved)"), steps=6, warmup=1)
    ap.add_argument("--micro-batch", type=int, default=None, help="slimectl's train.max_tokens_per_micro_batch")
    ap.add_argument("--trl-python", default=sys.executable, help="interpreter with trl installed")
    ap.add_argument("--trl-pythonpath", default="", help="prepended to the TRL worker's PYTHONPATH")
    ap.add_argument("--no-trl", action="store_true", help="slimectl's side only (where TRL is not installed)")
    ap.add_argument("--offload", action="store_true",
                    help="engine.offload_during_train: the engine frees its weights and KV cache while the actor trains")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for slimectl's side (repeatable), e.g. sync.transport=distributed")
    a = ap.parse_args()
    if (a.model is None) == (not a.tiny_model):
        ap.error("give --model DIR or --tiny-model")
    work = Path(tempfile.mkdtemp(prefix="rl_vs_trl_"))
    model = a.model
    if a.tiny_model:
        from slimectl.starter_models.tiny_models import build_tiny_model

        model = build_tiny_model("qwen2", work / "tiny-qwen2", seed=0)
    n_params = count_params(model)
    results: dict[str, list[dict]] = {"slimectl rl": [], "TRL GRPOTrainer": []}
    for r in range(a.rounds):  # A B A B: drift of a shared machine hits both sides alike
        (work / f"a{r}").mkdir()
        results["slimectl rl"].append(run_slimectl(work / f"a{r}", model, a, r))
        if not a.no_trl:
            results["TRL GRPOTrainer"].append(run_trl(work, model, a, r))
    print(f"model {model} ({n_params / 1e6:.1f}M parameters), "
          f"{a.prompts} prompts x {a.samples} samples x <= {a.new_tokens} tokens, lr {a.lr}, "
          f"{a.steps} steps per run ({a.warmup} dropped), {a.rounds} rounds interleaved")
    summary = {}
    for side, runs in results.items():
        if not runs:
            continue
        step = statistics.median(x["step_s"] for x in runs)
        phases = {k: statistics.median(x["phases_s"][k] for x in runs if x["phases_s"].get(k) is not None)
                  for k in runs[0]["phases_s"] if runs[0]["phases_s"][k] is not None}
        peak = max(x["tree_gb"] for x in runs)
        procs = max((x["per_process_gb"] for x in runs), key=lambda d: sum(d.values()))
        summary[side] = step
        print(f"{side:>16}: step {step:.2f} s (" + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()) +
              f"), {statistics.median(x['tokens_per_s'] for x in runs):.0f} tok/s, peak RSS tree {peak:.2f} GB "
              "[" + "; ".join(f"{k.split(' ', 1)[1] or k}: {v:.2f} GB = {v * 2**30 / n_params:.1f} B/param"
                              for k, v in procs.items()) + "]")
    if "TRL GRPOTrainer" in summary:
        print(f"ratio rl / TRL: {summary['slimectl rl'] / summary['TRL GRPOTrainer']:.2f}x")
    print(json.dumps({"results": results, "args": {k: str(v) for k, v in vars(a).items()}}))


if __name__ == "__main__":
    main()
