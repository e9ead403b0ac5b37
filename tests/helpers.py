"""Helpers shared by the test suite: paths, subprocess runners, engines, serve, HTTP calls, rl configs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
ARITH = ROOT / "examples" / "data" / "arith.jsonl"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread per child: the suite runs on 2 shared cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_py(code: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run python code in a fresh interpreter (for kill -9 and import-isolation tests)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env)


def slimectl(*args, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m slimectl ARGS` in a fresh interpreter, output captured (one OMP thread)."""
    return subprocess.run([sys.executable, "-m", "slimectl", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**ENV, **(env or {})})


@contextlib.contextmanager
def in_process_stage():
    """Run single-rank Megatron work (a stage, a test script) in this process, then tidy up.

    Megatron's CPU shim (backends/megatron/cpu_compat) is applied by the first Megatron call and
    stays for the session, as do the one-rank gloo group and Megatron's groups; the shim's
    device-rewriting torch mode is on only inside these blocks, so other tests in this process see
    plain torch. What the work leaves in os.environ (RANK, MASTER_PORT...), the SIGINT/SIGTERM
    handlers and slimectl's console log handler (bound to a captured stderr) are put back afterwards.
    """
    import logging
    import signal

    from slimectl.backends.megatron import cpu_compat, parallel

    log = logging.getLogger("slimectl")

    def drop_console_handler():
        for h in [h for h in log.handlers if getattr(h, "_slimectl_console", False)]:
            log.removeHandler(h)

    saved_env = dict(os.environ)
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    drop_console_handler()  # setup_logging binds a fresh one to the current stderr
    if cpu_compat.applied():
        cpu_compat._mode.__enter__()
    # Keep Megatron's one-rank groups from call to call (init_parallel reuses them): torch does not
    # free a destroyed gloo group's sockets and pipes, so tearing down per call leaks ~70 fds each.
    shutdown = parallel.shutdown_parallel
    parallel.shutdown_parallel = lambda destroy_process_group=False: None
    try:
        yield
    finally:
        parallel.shutdown_parallel = shutdown
        if cpu_compat.applied():
            cpu_compat._mode.__exit__(None, None, None)
        drop_console_handler()
        os.environ.clear()
        os.environ.update(saved_env)
        for s, h in saved_signals.items():
            signal.signal(s, h)


def slimectl_in_process(*args, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`slimectl ARGS` through click's CliRunner in this process, answered like :func:`slimectl`.

    For single-rank stages (init, train, convert, export, sync, rollout import): the imports are
    paid once per session instead of once per call (see :func:`in_process_stage`). Multi-rank
    (torchrun), kill -9 and Ray tests use :func:`slimectl` instead.
    """
    from click.testing import CliRunner

    from slimectl.commands.cli import cli

    with in_process_stage():
        res = CliRunner().invoke(cli, [str(a) for a in args], env=env, prog_name="slimectl", catch_exceptions=False)
    return subprocess.CompletedProcess(["slimectl", *map(str, args)], res.exit_code, res.stdout, res.stderr)


def run_script_in_process(script: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGV`` (one of tests/scripts) in this process: its main() with sys.argv set
    and stdout captured, answered like subprocess.run. The scripts keep the one-rank process group
    when not run as __main__. Multi-rank runs go through torchrun instead."""
    import io
    import runpy

    out = io.StringIO()
    saved_argv = sys.argv
    with in_process_stage():
        os.environ.update(env or {})
        try:
            sys.argv = [str(script), *map(str, argv)]
            with contextlib.redirect_stdout(out):
                runpy.run_path(str(script), run_name="__in_process__")["main"]()
        finally:
            sys.argv = saved_argv
    return subprocess.CompletedProcess([str(script), *map(str, argv)], 0, out.getvalue(), "")


def start_engine(model: Path, log: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """An embedded engine server subprocess on a free port (weight version 0 unless ARGS set one): (proc, url)."""
    port = free_port()
    if "--weight-version" not in args:
        args = (*args, "--weight-version", "0")
    proc = subprocess.Popen([sys.executable, "-m", "slimectl.engines.embedded.server", "--model-path", str(model),
                             "--port", str(port), *args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**ENV, **(env or {})})
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(*urls: str, timeout: float = 120) -> None:
    """Block until every engine URL answers /health."""
    from slimectl.engines.client import EngineClient

    async def go():
        for u in urls:
            async with EngineClient(u, retries=0) as c:
                await c.wait_healthy(timeout=timeout, interval=0.2)

    asyncio.run(go())


def post(url: str, path: str, body, timeout: float = 30):
    """POST JSON, return the decoded JSON answer."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def expected_engines(args) -> int:
    if "--engine-url" in args:
        return list(args).count("--engine-url")
    return int(args[list(args).index("--num-engines") + 1]) if "--num-engines" in args else 1


def start_serve(run, *args: str) -> tuple[subprocess.Popen, list[str]]:
    """`slimectl serve -r RUN ARGS` as a subprocess; returns once it has printed every engine URL."""
    proc = subprocess.Popen([sys.executable, "-m", "slimectl", "serve", "-r", str(run.path), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    urls = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        urls.append(line.strip())
        if len(urls) == expected_engines(args):
            return proc, urls
    proc.kill()
    raise AssertionError(f"serve did not announce its engines: {urls} {proc.stderr.read()[-3000:]}")


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_config(tmp_path, **sections) -> Path:
    """A small rl config (3 rollouts of 2 prompts x 4 samples, 6 tokens, random reward) with SECTIONS merged in."""
    cfg = {"name": "t", "data": {"prompt_data": str(ARITH)},
           "rollout": {"num_rollout": 3, "batch_size": 2, "n_samples_per_prompt": 4, "max_response_len": 6,
                       "reward": "random"},
           "train": {"lr": 1e-3}, "logging": {"tensorboard": False}}
    for sec, values in sections.items():
        cfg.setdefault(sec, {}).update(values)
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def engine_pids(run) -> list[int]:
    """PIDs of embedded engine servers started for RUN (by its path on their command line)."""
    import psutil

    return [p.pid for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] and "slimectl.engines.embedded.server" in p.info["cmdline"]
            and str(run.path) in " ".join(p.info["cmdline"])]


def assert_trained_once(run, n: int) -> None:
    cur = run.cursor("train").read()
    assert cur.next == n and cur.consumed == list(range(n))
    assert run.rollouts.ids() == list(range(n))
    last = run.checkpoints.get(run.checkpoints.ids()[-1])
    assert last.meta["next_rollout"] == n and last.meta["actor_step"] == n  # one step per rollout, none twice


async def zero_reward(args, sample):
    """Pure distillation: no task reward, only the teacher's log-probs shape the advantages."""
    return 0.0
