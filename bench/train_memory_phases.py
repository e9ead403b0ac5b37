"""bench/train_memory_phases.py — where the trainer's memory goes, phase by phase.

Builds a run directory on ``--model DIR`` (an HF folder, e.g. SmolLM2-135M-Instruct from
``slimectl init --pretrained smollm2-135m``) or on a random qwen2 of the same structure
(``--tiny``: ``--hidden``/``--layers``/``--vocab``), converts it, publishes ``--rollouts`` READY
rollouts of random samples (``--samples`` x (``--prompt`` + ``--response``) tokens) and runs the
train stage's :class:`Trainer` on them in a fresh child process, as ``slimectl rl`` does
(``publish_weights`` and a checkpoint after every rollout, written in the background).

The child samples its RSS (``/proc/self/statm``) every 5 ms and attributes each sample to the
phase the training thread is in (the background checkpoint writer flagged with ``+save``):

- ``build``: the actor (GPTModel + DDP grad buffer + optimizer), ``load``: the initial weights;
- per rollout: ``forward`` / ``backward`` (every micro-batch), ``loss`` (the rest of the step
  before the optimizer), ``optimizer``, ``weights`` (publishing ``weights/N``), ``save`` (the
  hand-over), ``other`` (reading samples, advantages, cursor...).

Prints one JSON line: per phase the peak RSS in MB and B/param, the RSS after the build steps,
the process's peak (``ru_maxrss``) in B/param, and the parameter count. ``--malloc-trim`` calls
glibc's ``malloc_trim(0)`` after every rollout (to measure what fragmentation holds).

    python bench/train_memory_phases.py --model ~/.cache/slimectl/models/smollm2-135m-instruct
    python bench/train_memory_phases.py --model ... --set train.recompute=none   # (default auto: full here)
    python bench/train_memory_phases.py --tiny --hidden 256 --layers 4 --vocab 8192
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, resource, sys, threading, time
spec = json.loads(sys.argv[1])
PAGE = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE
import torch, megatron.core
import slimectl.stages.train.publish as publish_mod
import slimectl.stages.train.trainer as train_mod
import slimectl.backends.megatron.actor as actor_mod
import slimectl.backends.megatron.checkpoint as ckpt_mod
from slimectl.contract.config import load_config
from slimectl.contract.rundir import RunDir

state = {"phase": "imports", "saving": 0, "rid": "", "win": 0}
peaks, marks, events = {}, {}, []
stop = threading.Event()
def sample():
    while not stop.is_set():
        key = state["rid"] + state["phase"] + ("+save" if state["saving"] else "")
        v = rss()
        if v > peaks.get(key, 0):
            peaks[key] = v
        state["win"] = max(state["win"], v)
        stop.wait(0.005)
threading.Thread(target=sample, daemon=True).start()
marks["imports"] = rss()

class phase:
    def __init__(self, name):
        self.name = name
    def __enter__(self):
        event(">" + self.name)
        self.prev, state["phase"] = state["phase"], self.name
    def __exit__(self, *exc):
        event("<" + self.name)
        state["phase"] = self.prev

def event(name):
    # (event, rss now, peak since the previous event), in MB; repeated micro-batch events folded
    v = rss()
    row = [state["rid"] + name, v >> 20, max(state["win"], v) >> 20]
    state["win"] = v
    if events and events[-1][0] == row[0]:
        events[-1][1] = row[1]; events[-1][2] = max(events[-1][2], row[2]); events[-1].append("x")
    else:
        events.append(row)

def wrap(obj, attr, name):
    fn = getattr(obj, attr)
    def wrapped(*a, **k):
        with phase(name):
            return fn(*a, **k)
    setattr(obj, attr, wrapped)

# forward = the micro-batch's log-probs (with grad), backward = torch.autograd.backward
wrap(actor_mod, "compute_log_probs", "forward")
_backward = torch.autograd.backward
def backward(*a, **k):
    with phase("backward"):
        return _backward(*a, **k)
torch.autograd.backward = backward
import slimectl.backends.hf.checkpoint as hf_ckpt_mod
wrap(hf_ckpt_mod, "write_safetensors_sharded", "weights")
_save = ckpt_mod.save_torch_dist
def save(*a, **k):
    state["saving"] += 1
    event("save-start")
    try:
        return _save(*a, **k)
    finally:
        state["saving"] -= 1
        event("save-end")
ckpt_mod.save_torch_dist = save
wrap(publish_mod, "publish_checkpoint", "save")

run = RunDir.open(spec["run"])
cfg = run.stage_config("train", [])
_Actor = actor_mod.MegatronActor
class Actor(_Actor):
    def __init__(self, *a, **k):
        with phase("build"):
            super().__init__(*a, **k)
        marks["after_build"] = rss()
        # the optimizer step, inside the step
        opt = self.model.optimizer
        step = opt.step
        def opt_step(*a, **k):
            with phase("optimizer"):
                return step(*a, **k)
        opt.step = opt_step
    def load_checkpoint(self, *a, **k):
        with phase("load"):
            r = super().load_checkpoint(*a, **k)
        marks["after_load"] = rss()
        return r
actor_mod.MegatronActor = Actor
trim = None
if spec["malloc_trim"]:
    import ctypes
    trim = ctypes.CDLL("libc.so.6").malloc_trim
from slimectl.contract.metrics import MetricsWriter
with run.lock("train") as lock:
    trainer = train_mod.Trainer(run, cfg, lock)
    marks["after_trainer"] = rss()
    metrics = MetricsWriter(run.metrics_path("train"), None)
    steps = []
    for rid in range(spec["rollouts"]):
        state["rid"] = f"r{rid}:"
        with phase("other"):
            t = time.perf_counter()
            art = run.rollouts.get(rid)
            out = trainer.train_rollout(rid, art, metrics, publish_weights=True, last=rid == spec["rollouts"] - 1)
            perf = {k: v for k, v in out[-1].items() if k.startswith("perf/")}
            steps.append({"wall_s": time.perf_counter() - t, **perf})
        marks[f"after_rollout_{rid}"] = rss()
        if trim is not None:
            trim(0)
            marks[f"after_rollout_{rid}_trimmed"] = rss()
    with phase("close"):
        trainer.close()
    marks["end"] = rss()
stop.set()
r = resource.getrusage(resource.RUSAGE_SELF)
print("BENCH " + json.dumps({"peaks": peaks, "marks": marks, "events": events, "maxrss": r.ru_maxrss * 1024,
                             "cpu_s": r.ru_utime + r.ru_stime, "steps": steps}), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="HF model directory")
    ap.add_argument("--tiny", action="store_true", help="a random qwen2 of --hidden/--layers/--vocab instead")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=30)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--set", action="append", default=[], help="extra config overrides (init --set)")
    ap.add_argument("--malloc-trim", action="store_true", help="malloc_trim(0) after each rollout")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the child (e.g. MALLOC_ARENA_MAX=2)")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    if (a.model is None) == (not a.tiny):
        ap.error("give --model DIR or --tiny")

    from safetensors import safe_open

    from slimectl.contract.rundir import RunDir
    from slimectl.contract.samples import SAMPLES_FILE, Sample, write_samples

    tmp = Path(tempfile.mkdtemp(prefix="bench_memph_"))
    model = a.model
    if a.tiny:
        from slimectl.starter_models.tiny_models import build_tiny_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build_tiny_model("qwen2", tmp / "m", hidden_size=a.hidden, num_layers=a.layers,
                                     num_heads=max(1, a.hidden // 64), num_kv_heads=max(1, a.hidden // 192),
                                     intermediate_size=a.hidden * 8 // 3, vocab_size=a.vocab,
                                     max_position_embeddings=max(512, a.prompt + a.response), seed=0)
    n_params = 0
    for f in Path(model).glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                n = 1
                for x in fh.get_slice(k).get_shape():
                    n *= x
                n_params += n
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    sets = [f"model.path={model}", f"rollout.num_rollout={a.rollouts}", "train.save_interval=1", "train.lr=1e-6",
            "logging.tensorboard=false", *a.set]
    run_dir = tmp / "run"
    for cmd in (["init", str(run_dir), *sum((["--set", s] for s in sets), [])], ["convert", "-r", str(run_dir)]):
        p = subprocess.run([sys.executable, "-m", "slimectl", *cmd], capture_output=True, text=True, env=env, cwd=tmp)
        if p.returncode:
            sys.exit(p.stderr)
    run = RunDir.open(run_dir)
    rng = random.Random(0)
    for rid in range(a.rollouts):
        samples = [Sample(index=i, group_index=i // 4, rollout_id=rid, response_length=a.response,
                          tokens=[rng.randrange(3, vocab) for _ in range(a.prompt + a.response)],
                          rollout_log_probs=[-1.0] * a.response, reward=float(rng.random() < 0.5))
                   for i in range(a.samples)]
        with run.rollouts.publish(rid, meta={"weight_version": "0"}) as d:
            write_samples(samples, d / SAMPLES_FILE)
    child_env = dict(env, **dict(e.split("=", 1) for e in a.env))
    spec = {"run": str(run_dir), "rollouts": a.rollouts, "malloc_trim": a.malloc_trim}
    child = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                           env=child_env, cwd=tmp)
    line = [x for x in child.stdout.splitlines() if x.startswith("BENCH ")]
    if child.returncode or not line:
        sys.exit(child.stderr[-4000:] + child.stdout[-2000:])
    res = json.loads(line[-1][6:])
    mb = 2 ** 20

    def fmt(v):
        return {"mb": round(v / mb), "B_per_param": round(v / n_params, 1)}

    print(json.dumps({
        "params": n_params,
        "peak_B_per_param": round(res["maxrss"] / n_params, 1), "peak_mb": round(res["maxrss"] / mb),
        "peaks": {k: fmt(v) for k, v in sorted(res["peaks"].items(), key=lambda kv: kv[1])},
        "marks": {k: fmt(v) for k, v in res["marks"].items()},
        "events_mb": [" ".join(map(str, e)) for e in res["events"]],
        "steps": res["steps"], "cpu_s": round(res["cpu_s"], 1),
        "shape": {k: str(v) for k, v in vars(a).items()}, **({"run": str(run_dir)} if a.keep else {}),
    }, indent=1))
    if not a.keep:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
