"""The CPU demo: a tiny offline model, an SFT warm start, then GRPO whose reward visibly rises.

    python examples/cpu_demo.py [RUN_DIR] [--seed N] [--sft-steps N] [--set KEY=VALUE ...] [--dry-run]
                                                            (default: runs/demo)

1. ``slimectl init RUN-warmstart``  a tiny offline Qwen2 (examples/sft_warmstart.yaml)
2. SFT samples ("\\boxed{a+b}" answers to the prompts) published as that run's rollouts
3. ``slimectl train -r RUN-warmstart``  100 SFT steps (algorithm.loss_type = sft_loss; --sft-steps)
4. ``slimectl rl --config examples/cpu_demo.yaml -r RUN``  GRPO from the warm start: the
   embedded engine, rollout -> train -> disk sync, eval with pass@k every 100 versions
   (--set KEY=VALUE overrides a key of cpu_demo.yaml, e.g. rollout.num_rollout=60)
5. ``slimectl plot -r RUN``  the reward curve, and RUN/plots/curves.png

Rerunning resumes every step from its run directory. --dry-run prints the resolved configs of
the warm start and of the RL run (``slimectl init/rl --dry-run``) and writes nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def slimectl_command() -> list[str]:
    """How slimectl is run: ``$SLIMECTL`` (a command, split as a shell would, as in examples/multinode's
    scripts), else this interpreter's ``python -m slimectl``."""
    return shlex.split(os.environ.get("SLIMECTL", "")) or [sys.executable, "-m", "slimectl"]


def slimectl(*args: str, ok=(0,)) -> int:
    if "--dry-run" in args:
        print("---", flush=True)  # stdout: one YAML document per resolved config
    print(f"$ slimectl {' '.join(args)}", file=sys.stderr, flush=True)
    rc = subprocess.run([*slimectl_command(), *args]).returncode
    if rc not in ok:
        sys.exit(f"slimectl {args[0]} failed with exit code {rc}")
    return rc


def publish_sft_rollouts(run_path: str, seed: int) -> None:
    """One SFT batch per rollout id: prompt tokens + "\\boxed{label}<eos>", every response token trained."""
    from transformers import AutoTokenizer

    from slimectl.contract.logs import quiet_hf_progress
    from slimectl.stages.rollout.data import load_prompts, tokenize_prompts
    from slimectl.contract.rundir import RunDir
    from slimectl.contract.samples import SAMPLES_FILE, Sample, Status, write_samples

    run = RunDir.open(run_path)
    cfg = run.config()
    quiet_hf_progress()
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    rows, _ = tokenize_prompts(load_prompts(cfg.data.prompt_data)[0], tok, cfg.data.apply_chat_template)
    rng = random.Random(seed)
    for rid in range(cfg.rollout.num_rollout):
        if run.rollouts.exists(rid):
            continue
        samples = []
        for i in range(cfg.rollout.batch_size):
            row = rng.choice(rows)
            answer = tok.encode(f"\\boxed{{{row.label}}}", add_special_tokens=False) + [tok.eos_token_id]
            s = Sample(group_index=i, index=i, rollout_id=rid, prompt=row.prompt_text, tokens=list(row.prompt_ids),
                       label=str(row.label))
            s.append_response_tokens(answer, [0.0] * len(answer), True, {"weight_version": "sft"})
            s.status, s.reward = Status.COMPLETED, 0.0
            samples.append(s)
        with run.rollouts.publish(rid, meta={"weight_version": "0", "kind": "sft"}, stage="sft-data") as d:
            write_samples(samples, d / SAMPLES_FILE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", default="runs/demo")
    ap.add_argument("--seed", type=int, default=0, help="seed of the SFT data, the model and the RL run")
    ap.add_argument("--sft-steps", type=int, default=None,
                    help="SFT steps of the warm start (its rollout.num_rollout and train.save_interval; "
                         "default: sft_warmstart.yaml's 100)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a key of cpu_demo.yaml for the RL run, e.g. rollout.num_rollout=60")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the resolved warm-start and RL configs and exit without doing anything")
    a = ap.parse_args()
    if a.sft_steps is not None and a.sft_steps < 1:
        ap.error(f"--sft-steps ({a.sft_steps}) must be >= 1")
    warm = f"{a.run}-warmstart"
    sft = [] if a.sft_steps is None else ["--set", f"rollout.num_rollout={a.sft_steps}",
                                          "--set", f"train.save_interval={a.sft_steps}"]
    dry = ["--dry-run"] if a.dry_run else []
    slimectl("init", warm, "--config", str(HERE / "sft_warmstart.yaml"), "--tiny-model", "qwen2",
             "--set", f"train.seed={1234 + a.seed}", *sft, *dry)
    if a.dry_run:  # the warm start's weights do not exist: the RL config names where they would be
        import yaml

        from slimectl.contract.rundir.artifacts import format_id

        steps = a.sft_steps or yaml.safe_load((HERE / "sft_warmstart.yaml").read_text())["rollout"]["num_rollout"]
        start_path = str(Path(warm) / "weights" / format_id(steps))
    else:
        publish_sft_rollouts(warm, a.seed)
        slimectl("train", "-r", warm, "--allow-empty")
        from slimectl.contract.rundir import RunDir

        start_path = str(RunDir.open(warm).weights.latest().path)
    slimectl("rl", "--config", str(HERE / "cpu_demo.yaml"), "-r", a.run, "--set", f"model.path={start_path}",
             "--set", f"rollout.seed={42 + a.seed}", "--set", f"data.seed={42 + a.seed}",
             "--set", f"train.seed={1234 + a.seed}", *(x for o in a.overrides for x in ("--set", o)), *dry)
    if not a.dry_run:
        slimectl("plot", "-r", a.run)


if __name__ == "__main__":
    main()
