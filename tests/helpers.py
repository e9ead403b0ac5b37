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


def script_results(proc: subprocess.CompletedProcess) -> list[dict]:
    """The ``RESULT {json}`` lines a tests/scripts script printed, parsed."""
    return [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def hf_logits_env(model: Path, tmp_path_factory) -> dict[str, str]:
    """The env for the *_logits.py scripts: HF's logits of ``model`` on the token ids of data-parallel
    ranks 0 and 1 (24 and 19 tokens per row), computed here once instead of in each rank of each launch."""
    import runpy

    path = tmp_path_factory.mktemp("hf-logits") / "logits.pt"
    runpy.run_path(str(SCRIPTS / "mcore_logits.py"))["write_hf_logits"](path, [model], [(2, 24, 7), (2, 19, 8)])
    return {"SLIMECTL_TEST_HF_LOGITS": str(path)}


def convert_tp1(model: Path, out: Path) -> list[int]:
    """Convert ``model`` to Megatron torch_dist at TP=1 into ``out`` (in this process); the number of
    tensors copied file to file, per model."""
    return script_results(run_script_in_process(SCRIPTS / "convert_batch.py", "1", "1", str(model), str(out)))[-1]["copied"]


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


class RankWorker:
    """N torchrun ranks kept alive to run tests/scripts jobs one after another (tests/scripts/rank_worker.py).

    ``run(SCRIPT, *ARGV)`` answers like ``torchrun --nproc_per_node N SCRIPT ARGV`` would (stdout of
    every rank in rank order, return code 0 or 1, the ranks' tracebacks as stderr) but the ranks'
    interpreter, torch/megatron imports and gloo group are paid once, not per call. The ranks start
    on the first run; a job that fails or times out stops them (a rank may be stuck in a collective)
    and the next run starts fresh ones. Multi-rank *CLI* launches (slimectl's own torchrun relaunch)
    still go through :func:`slimectl`.
    """

    def __init__(self, nproc: int, root: Path):
        self.nproc, self.root = nproc, Path(root)
        self.proc: subprocess.Popen | None = None
        self.launches = 0
        self.jobs = Path()
        self.next_job = 0
        self.cpu_log: list[tuple[str, list[str], float]] = []  # (script, argv, CPU seconds of all ranks)
        self.proc_rc: int | None = None
        self._log = None

    def start(self) -> None:
        self.launches += 1
        self.jobs = self.root / f"launch-{self.launches}"
        self.jobs.mkdir(parents=True)
        self.next_job = 0
        self._log = open(self.jobs / "worker.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(self.nproc), "--master_addr",
             "127.0.0.1", "--master_port", str(free_port()), str(SCRIPTS / "rank_worker.py"), str(self.jobs)],
            stdout=self._log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)

    def log_tail(self) -> str:
        return (self.jobs / "worker.log").read_text()[-3000:] if (self.jobs / "worker.log").is_file() else ""

    def run(self, script, *argv, env: dict[str, str] | None = None, timeout: float = 300,
            check: bool = True) -> subprocess.CompletedProcess:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        i, self.next_job = self.next_job, self.next_job + 1
        job = {"script": str(script), "argv": [str(a) for a in argv], "env": env or {}}
        tmp = self.jobs / f".job-{i}.tmp"
        tmp.write_text(json.dumps(job))
        tmp.rename(self.jobs / f"job-{i}.json")
        outs = [self.jobs / f"job-{i}.rank{r}.json" for r in range(self.nproc)]
        deadline = time.monotonic() + timeout
        while not all(o.exists() for o in outs):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop(force=True)
                raise AssertionError(f"rank worker: job {job} got no answer (worker exit {self.proc_rc}): {tail}")
            time.sleep(0.02)
        answers = [json.loads(o.read_text()) for o in outs]
        errors = [a["error"] for a in answers if a["error"]]
        res = subprocess.CompletedProcess(["torchrun", str(script), *job["argv"]], 1 if errors else 0,
                                          "".join(a["stdout"] for a in answers), "\n".join(errors))
        self.cpu_log.append((Path(script).name, job["argv"], sum(a["cpu_s"] for a in answers)))
        if errors:
            self.stop(force=True)  # the other rank may wait in a collective forever
            if check:
                raise AssertionError(f"rank worker: {script} {job['argv']} failed:\n{res.stderr[-3000:]}")
        return res

    def stop(self, force: bool = False) -> None:
        """End the ranks (reaped here, so their CPU time counts for the test that ends them)."""
        if self.proc is None:
            return
        (self.jobs / "stop").write_text("")
        try:
            self.proc.wait(timeout=0 if force else 30)
        except subprocess.TimeoutExpired:
            import signal

            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc_rc, self.proc = self.proc.returncode, None
        self._log.close()
        (self.root / "cpu.json").write_text(json.dumps(self.cpu_log))  # CPU seconds per job, for the curious


def start_engine(model: Path, log: Path, *args: str, env: dict[str, str] | None = None,
                 own_process: bool = False) -> tuple[subprocess.Popen, str]:
    """An embedded engine server subprocess (weight version 0 unless ARGS set one): (proc, url). Its port is the
    one the system gave its socket (``--port 0``, read from ``--port-file`` once bound, before the model loads):
    a port picked here and bound there seconds later could be taken meanwhile by another test's engine, whose
    answers this test would then read (seen in CI). It is forked by the suite's engine fork server
    (tests/conftest.py) unless ``own_process``: then ``proc`` is the engine's own process (the one that listens)."""
    if "--weight-version" not in args:
        args = (*args, "--weight-version", "0")
    port_file = Path(f"{log}.port")
    port_file.unlink(missing_ok=True)
    from slimectl.engines.embedded import server_argv

    cmd = [sys.executable, "-m", "slimectl.engines.embedded.server"] if own_process else server_argv(sys.executable)
    proc = subprocess.Popen([*cmd, "--model-path", str(model),
                             "--port", "0", "--port-file", str(port_file), *args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**ENV, **(env or {})})
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"engine (pid {proc.pid}) bound no port (exit {proc.poll()}); see {log}:\n"
                                 f"{Path(log).read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{int(port_file.read_text())}"


def stop_engine(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM an engine started by :func:`start_engine`, SIGKILL if it is not gone within ``timeout`` s."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def load_tensors(scheduler, named_tensors, weight_version: str | None = None) -> None:
    """Copy (HF name, tensor) pairs into an in-process embedded engine's weights between its scheduler steps,
    through the path a distributed update takes (``receive_weights``: every name and shape checked first,
    ValueError and nothing applied otherwise)."""
    named = list(named_tensors)
    tensors = iter([t for _, t in named])
    scheduler.receive_weights([(n, t.dtype, tuple(t.shape)) for n, t in named], lambda out: out.copy_(next(tensors)),
                              weight_version)


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


def start_serve(run, *args: str, env: dict[str, str] | None = None, timeout: float = 180,
                stderr_file: Path | None = None) -> tuple[subprocess.Popen, list[str]]:
    """`slimectl serve -r RUN ARGS` as a subprocess (ENV plus ``env``; stderr to ``stderr_file`` if
    given); returns once it has printed every engine URL, within ``timeout`` seconds."""
    err = open(stderr_file, "w") if stderr_file is not None else subprocess.PIPE
    proc = subprocess.Popen([sys.executable, "-m", "slimectl", "serve", "-r", str(run.path), *args],
                            stdout=subprocess.PIPE, stderr=err, text=True, env={**ENV, **(env or {})})
    urls = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        urls.append(line.strip())
        if len(urls) == expected_engines(args):
            return proc, urls
    proc.kill()
    proc.wait()
    tail = Path(stderr_file).read_text() if stderr_file is not None else proc.stderr.read()
    raise AssertionError(f"serve did not announce its engines: {urls}\n{tail[-3000:]}")


def publish_weights(run, version: int, seed: int) -> dict:
    """weights/VERSION: the run's initial model with noise added to every tensor (so outputs change)."""
    import torch
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


def scheduler_rollouts(model: Path, n_rollouts: int, version=lambda rid, group: "0") -> list[list]:
    """``n_rollouts`` rollouts of 4 groups of 2 samples of 8 tokens from the embedded engine's scheduler on
    ``model`` (prompt ``[5 + rid, 6 + group, 7, 8]``, seed ``1000 * rid + index``), each sample's weight
    version ``version(rid, group)`` and reward 1 for even indices (each group has one winner: non-zero std)."""
    from slimectl.contract.samples import Sample, Status
    from slimectl.engines.embedded.requests import GenRequest
    from slimectl.engines.embedded.sampling_params import SamplingParams
    from slimectl.engines.embedded.scheduler import GenerationScheduler

    scheduler = GenerationScheduler(str(model))
    scheduler.start()
    out = []
    try:
        for rid in range(n_rollouts):
            futs = []
            for g in range(4):
                prompt = [5 + rid, 6 + g, 7, 8]
                for j in range(2):
                    idx = g * 2 + j
                    futs.append((g, idx, prompt, scheduler.submit(GenRequest(f"r{rid}-{idx}", prompt, SamplingParams(
                        max_new_tokens=8, temperature=1.0, sampling_seed=1000 * rid + idx),
                        return_logprob=True))))
            samples = []
            for g, idx, prompt, fut in futs:
                res = fut.result(timeout=120)
                s = Sample(group_index=g, index=idx, rollout_id=rid, tokens=list(prompt), prompt="p")
                s.append_response_tokens(res.output_ids, res.output_token_logprobs, True,
                                         {"weight_version": version(rid, g)})
                s.status = Status.COMPLETED
                s.reward = float(idx % 2 == 0)
                samples.append(s)
            out.append(samples)
    finally:
        scheduler.stop()
    return out


def wait_turns_recorded(harness, sid: str, timeout: float = 10.0) -> None:
    """Wait until the harness has recorded every turn of session ``sid``: a streamed turn is recorded just after its
    last event reached the client (``Harness.turns_in_flight``)."""
    deadline = time.monotonic() + timeout
    while harness.turns_in_flight(sid) and time.monotonic() < deadline:
        time.sleep(0.01)
