"""Helpers of the conformance suite (real SGLang on CPU): runs, `slimectl serve --backend sglang`, greedy calls."""

from __future__ import annotations

import functools
import signal
import subprocess
from pathlib import Path

from slimectl.contract.rundir import RunDir
from tests.helpers import ARITH, post, publish_weights, slimectl_in_process, start_serve  # noqa: F401 (publish_weights: re-exported)

#: what SGLang 0.5.23 needs on CPU besides SGLANG_USE_CPU_ENGINE=1 (docs/sglang-on-cpu.md), and two flags
#: that cut the suite's cost without changing a path slimectl takes:
#: --sleep-on-idle: an idle scheduler waits on its sockets instead of spinning (measured: ~0.2 CPU-s per
#: idle second per engine without it, ~0.02 with it; the suite's engines idle while the tests compute);
#: --skip-server-warmup: SGLang's own warm-up /generate is skipped; slimectl's readiness check
#: (`/health_generate`, one generated token) is the first request either way.
CPU_ARGS = ("{device: cpu, attention_backend: torch_native, sampling_backend: pytorch, max_total_tokens: 4096, "
            "sleep_on_idle: true, skip_server_warmup: true}")
#: The engines' environment. SGLANG_USE_CPU_ENGINE=1 is REQUIRED on CPU; here it reaches the servers through
#: the environment slimectl (serve, rl) runs in, which they inherit (`engine.env` is the config's way to set it).
SGLANG_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
#: The model modules of sglang/srt/models/ the suite serves (its tiny Llama, Qwen2 and Qwen2.5-VL). SGLang's scheduler
#: imports every module there to fill its registry (~250; 15 fail on CPU and are logged) unless
#: SGLANG_DISABLED_MODEL_ARCHS names it: measured 2.3-2.6 CPU-s per engine start (docs/sglang-on-cpu.md).
SERVED_MODEL_MODULES = frozenset({"llama", "qwen2", "qwen2_5_vl"})


@functools.lru_cache(maxsize=None)
def sglang_env(sglang_python: str) -> dict[str, str]:
    """SGLANG_ENV plus SGLANG_DISABLED_MODEL_ARCHS: every model module of SGLANG_PYTHON's sglang but the
    ones the suite serves (found without importing sglang)."""
    res = subprocess.run([sglang_python, "-c", "import importlib.util as u; "
                          "print(u.find_spec('sglang').submodule_search_locations[0])"],
                         capture_output=True, text=True, timeout=120, check=True)
    models = Path(res.stdout.strip()) / "srt" / "models"
    names = sorted(p.stem for p in models.glob("*.py") if p.stem != "__init__")
    assert SERVED_MODEL_MODULES <= set(names), f"{models} lacks {sorted(SERVED_MODEL_MODULES - set(names))}"
    return {**SGLANG_ENV, "SGLANG_DISABLED_MODEL_ARCHS": ",".join(n for n in names if n not in SERVED_MODEL_MODULES)}
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
    """`slimectl serve -r RUN ARGS` (backend sglang from the run's config) with the engines' CPU
    environment (:func:`sglang_env`); returns once it printed every engine URL."""
    env = sglang_env(run.config().engine.sglang_python)
    return start_serve(run, *args, env=env, timeout=START_TIMEOUT, stderr_file=run.path / "serve.stderr")


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


def sglang_pids(run: RunDir) -> list[int]:
    """PIDs of the SGLang servers (``python -m sglang.launch_server``) serving a model of RUN."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "sglang.launch_server" in cmd and f"{run.path}/" in cmd:
            out.append(p.pid)
    return out
