"""On-policy distillation on CPU: a served teacher, a weaker student, and the student's reverse KL falling.

    python examples/opd_demo.py [RUN] [--seed N]        (default: runs/opd-demo)

1. ``slimectl init RUN-sft`` + ``slimectl train``: the tiny offline Qwen2 learns "\\boxed{a+b}"
   answers by SFT (the CPU demo's warm start, examples/sft_warmstart.yaml). Its weights after
   ``--student-steps`` steps are the student, after ``--teacher-steps`` the teacher: one base
   model, the teacher trained longer (100 vs 20 steps by default) and much more peaked.
2. ``slimectl init RUN-teacher`` + ``slimectl serve -r RUN-teacher``: the teacher on its own
   embedded engine; its URL goes into ``rollout.teacher_urls``.
3. The exact reverse KL(student || teacher) on a fixed prompt set (see :func:`exact_reverse_kl`).
4. ``slimectl rl --config examples/opd_demo.yaml -r RUN``: zero task reward, so the only signal is
   OPD's per-token advantage ``-(log pi_student(a_t) - log pi_teacher(a_t))`` of each sampled token.
5. The exact reverse KL again, the ``rollout/opd_reverse_kl`` trend from RUN/metrics/rollout.jsonl,
   and both in RUN/opd_demo.json.

Rerunning resumes every step from its run directories (the teacher gets a fresh URL each time).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KL_PROMPTS = HERE / "data" / "arith.jsonl@[224:256]"  # not among opd_demo.yaml's RL prompts (rows 0-223)
SUMMARY_FILE = "opd_demo.json"


async def zero_reward(args, sample) -> float:
    """No task reward (``rollout.reward: opd_demo:zero_reward``): pure distillation."""
    return 0.0


def _env() -> dict[str, str]:
    """Subprocess environment: ``opd_demo:zero_reward`` importable, one BLAS thread per process
    (the engines and the trainer share 2 cores)."""
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def slimectl_command() -> list[str]:
    from cpu_demo import slimectl_command as command  # $SLIMECTL, else python -m slimectl

    return command()


def slimectl(*args: str) -> None:
    print(f"$ slimectl {' '.join(args)}", file=sys.stderr, flush=True)
    rc = subprocess.run([*slimectl_command(), *args], check=False, env=_env()).returncode
    if rc != 0:
        sys.exit(f"slimectl {args[0]} failed with exit code {rc}")


def make_student_and_teacher(sft: str, seed: int, student_steps: int, teacher_steps: int) -> tuple[str, str]:
    """One SFT run saving weights every ``student_steps`` steps (kept: ``sync.keep_weights=null``)
    and after the last; (student dir, teacher dir) = its weights at ``student_steps`` and ``teacher_steps``."""
    from cpu_demo import publish_sft_rollouts

    from slimectl.contract.rundir import RunDir

    slimectl("init", sft, "--config", str(HERE / "sft_warmstart.yaml"), "--tiny-model", "qwen2",
             "--set", "name=opd-demo-sft", "--set", f"rollout.num_rollout={teacher_steps}",
             "--set", f"train.save_interval={student_steps}", "--set", "sync.keep_weights=null",
             "--set", f"train.seed={1234 + seed}")
    publish_sft_rollouts(sft, seed)
    slimectl("train", "-r", sft, "--allow-empty")
    run = RunDir.open(sft)
    return str(run.weights.get(student_steps).path), str(run.weights.get(teacher_steps).path)


def exact_reverse_kl(student_dir: str, teacher_dir: str, num_samples: int, max_new_tokens: int, seed: int) -> float:
    """Mean over response positions of the full-vocabulary KL(pi_student || pi_teacher).

    Not the rollout's one-sample estimate ``log pi_s(a) - log pi_t(a)`` (noisy, and it only sees
    the sampled token): at every position of the student's own sampled responses (temperature 1,
    a fixed seed, ``num_samples`` per prompt of KL_PROMPTS, up to the eos or ``max_new_tokens``)
    the sum over the whole vocabulary ``sum_v pi_s(v) (log pi_s(v) - log pi_t(v))``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slimectl.contract.logs import quiet_hf_progress
    from slimectl.stages.rollout.data import load_prompts, tokenize_prompts

    quiet_hf_progress()
    tok = AutoTokenizer.from_pretrained(teacher_dir)
    rows, _ = tokenize_prompts(load_prompts(str(KL_PROMPTS))[0], tok)
    student = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    gen = torch.Generator().manual_seed(seed)
    total, positions = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row.prompt_ids] * num_samples)
            alive = torch.ones(num_samples, dtype=torch.bool)
            for _ in range(max_new_tokens):
                lp_s = torch.log_softmax(student(ids).logits[:, -1].float(), -1)
                lp_t = torch.log_softmax(teacher(ids).logits[:, -1].float(), -1)
                kl = (lp_s.exp() * (lp_s - lp_t)).sum(-1)
                total += float(kl[alive].sum())
                positions += int(alive.sum())
                nxt = torch.multinomial(lp_s.exp(), 1, generator=gen)
                ids = torch.cat([ids, nxt], 1)
                alive &= nxt[:, 0] != tok.eos_token_id
                if not alive.any():
                    break
    return total / positions


def serve_teacher(teacher_run: str) -> tuple[subprocess.Popen, str]:
    """``slimectl serve -r TEACHER_RUN`` in the background; returns it and the URL it prints."""
    print(f"$ slimectl serve -r {teacher_run} &", file=sys.stderr, flush=True)
    proc = subprocess.Popen([*slimectl_command(), "serve", "-r", teacher_run],
                            stdout=subprocess.PIPE, text=True, env=_env())
    url = proc.stdout.readline().strip()
    if not url.startswith("http"):
        proc.wait()
        sys.exit(f"slimectl serve -r {teacher_run} failed with exit code {proc.returncode}")
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # serve stops its engines and unregisters them
    proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", default="runs/opd-demo")
    ap.add_argument("--seed", type=int, default=0, help="seed of the SFT data, the models and the RL run")
    ap.add_argument("--student-steps", type=int, default=20, help="SFT steps of the student")
    ap.add_argument("--teacher-steps", type=int, default=100, help="SFT steps of the teacher")
    ap.add_argument("--kl-samples", type=int, default=4, help="student samples per KL prompt")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a key of opd_demo.yaml for the RL run, e.g. rollout.num_rollout=20")
    a = ap.parse_args()
    if not 0 < a.student_steps < a.teacher_steps:
        ap.error(f"--student-steps ({a.student_steps}) must be > 0 and < --teacher-steps ({a.teacher_steps})")
    if a.kl_samples < 1:
        ap.error(f"--kl-samples ({a.kl_samples}) must be >= 1")
    t0 = time.monotonic()
    student, teacher = make_student_and_teacher(f"{a.run}-sft", a.seed, a.student_steps, a.teacher_steps)

    from slimectl.contract.rundir import RunDir
    from slimectl.contract.rundir.atomic import atomic_write_json

    slimectl("init", f"{a.run}", "--config", str(HERE / "opd_demo.yaml"), "--set", f"model.path={student}",
             "--set", f"rollout.seed={42 + a.seed}", "--set", f"data.seed={42 + a.seed}",
             "--set", f"train.seed={1234 + a.seed}", *(x for o in a.overrides for x in ("--set", o)))
    cfg = RunDir.open(a.run).config()
    kl_args = (a.kl_samples, cfg.rollout.max_response_len, a.seed)
    kl_start = exact_reverse_kl(student, teacher, *kl_args)
    print(f"exact reverse KL(student || teacher) at the start: {kl_start:.3f} nats/token", flush=True)

    slimectl("init", f"{a.run}-teacher", "--set", "name=opd-demo-teacher", "--set", f"model.path={teacher}")
    proc, url = serve_teacher(f"{a.run}-teacher")
    try:  # the teacher's URL changes from run to run: a stage override, not part of the frozen config
        slimectl("rl", "-r", a.run, "--set", f"rollout.teacher_urls=[{url}]")
    finally:
        stop(proc)

    run = RunDir.open(a.run)
    kl_end = exact_reverse_kl(str(run.weights.latest().path), teacher, *kl_args)
    rows = [json.loads(line) for line in run.metrics_path("rollout").read_text().splitlines() if line.strip()]
    sampled = [r["rollout/opd_reverse_kl"] for r in rows]
    summary = {"seed": a.seed, "exact_reverse_kl_start": kl_start, "exact_reverse_kl_end": kl_end,
               "rollout_opd_reverse_kl": sampled, "wall_s": time.monotonic() - t0}
    atomic_write_json(run.path / SUMMARY_FILE, summary)
    k = min(5, len(sampled))
    print(f"exact reverse KL(student || teacher): {kl_start:.3f} -> {kl_end:.3f} nats/token "
          f"(x{kl_end / kl_start:.2f}) on {len(sampled)} rollouts")
    print(f"rollout/opd_reverse_kl (one-sample estimate): first {k} mean {sum(sampled[:k]) / k:.3f} -> "
          f"last {k} mean {sum(sampled[-k:]) / k:.3f}; every rollout: {' '.join(f'{x:.2f}' for x in sampled)}")
    print(f"summary in {run.path / SUMMARY_FILE}; {summary['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
