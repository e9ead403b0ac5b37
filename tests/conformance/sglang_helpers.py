"""Helpers of the conformance suite (real SGLang on CPU): runs, `slimectl serve --backend sglang`, greedy calls."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from slimectl.contract.rundir import RunDir
from tests.helpers import ARITH, ENV, expected_engines, post, slimectl_in_process

#: what SGLang 0.5.23 needs on CPU besides SGLANG_USE_CPU_ENGINE=1 (docs/sglang-on-cpu.md)
CPU_ARGS = "{device: cpu, attention_backend: torch_native, sampling_backend: pytorch, max_total_tokens: 4096}"
#: The engines' environment. SGLANG_USE_CPU_ENGINE=1 is REQUIRED on CPU; until the config has `engine.env`
#: it reaches the servers through the environment slimectl (serve, rl) runs in, which they inherit.
SGLANG_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
START_TIMEOUT = 900  # seconds: 20-35 s on an idle 2-core machine, minutes when it is shared


def init_sglang_run(root: Path, family: str, sglang_python: str, *sets: str) -> RunDir:
    """A run with a tiny FAMILY model (fp32), engines on real SGLang (CPU flags) and small rollouts."""
    base = ["logging.tensorboard=false", "engine.backend=sglang", f"engine.sglang_python={sglang_python}",
            f"engine.sglang_args={CPU_ARGS}", f"engine.startup_timeout_s={START_TIMEOUT}", "model.dtype=fp32",
            f"data.prompt_data={ARITH}", "rollout.reward=random"]
    args = [x for s in (*base, *sets) for x in ("--set", s)]
    res = slimectl_in_process("init", root / "run", "--tiny-model", family, *args)
    assert res.returncode == 0, res.stderr[-3000:]
    return RunDir.open(root / "run")


def start_sglang_serve(run: RunDir, *args: str) -> tuple[subprocess.Popen, list[str]]:
    """`slimectl serve -r RUN ARGS` (backend sglang from the run's config) as a subprocess, with the engines'
    CPU environment; returns once it printed every engine URL."""
    err = open(run.path / "serve.stderr", "w")
    proc = subprocess.Popen([sys.executable, "-m", "slimectl", "serve", "-r", str(run.path), *args],
                            stdout=subprocess.PIPE, stderr=err, text=True, env={**ENV, **SGLANG_ENV})
    urls: list[str] = []
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline and len(urls) < expected_engines(args):
        line = proc.stdout.readline()
        if not line:
            break
        urls.append(line.strip())
    if len(urls) == expected_engines(args):
        return proc, urls
    proc.kill()
    proc.wait()
    raise AssertionError(f"serve did not announce its engines: {urls}\n{(run.path / 'serve.stderr').read_text()[-3000:]}")


def stop_serve(proc: subprocess.Popen, timeout: float = 120) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def greedy(url: str, ids, n: int = 12) -> tuple[list[int], list[float], str]:
    """Greedy decode of N tokens after IDS: (output ids, their log-probs, weight version)."""
    out = post(url, "/generate", {"input_ids": list(ids), "return_logprob": True,
                                  "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}},
               timeout=300)
    return out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]], out["meta_info"]["weight_version"]


def publish_weights(run: RunDir, version: int, seed: int) -> dict[str, torch.Tensor]:
    """weights/VERSION: the initial model with noise added to every tensor (so outputs change)."""
    from safetensors.torch import load_file

    from slimectl.backends.hf.checkpoint import write_safetensors_sharded
    from slimectl.backends.megatron.checkpoint import copy_hf_aux_files

    model = run.config().model.path
    base = load_file(os.path.join(model, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    new = {k: v + 0.3 * torch.randn(v.shape, generator=g) * (v.std() if v.numel() > 1 else 1.0) for k, v in base.items()}
    with run.weights.publish(version, meta={"weight_version": version}) as d:
        write_safetensors_sharded(new.items(), d)
        copy_hf_aux_files(model, d)
    return new


def sglang_pids(run: RunDir) -> list[int]:
    """PIDs of the SGLang servers (``python -m sglang.launch_server``) serving a model of RUN."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "sglang.launch_server" in cmd and f"{run.path}/" in cmd:
            out.append(p.pid)
    return out
