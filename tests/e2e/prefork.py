"""A fork server for the e2e tests that kill `slimectl` (kill -9, SIGTERM): one interpreter pays the
imports of a `slimectl rl` driver once (torch, megatron-core, transformers, the stages: ~10 CPU-s),
then forks one child per run. Each child is a real process of its own that runs the CLI's entry
point (`slimectl.commands.cli.main`, what `python -m slimectl` runs) with its own argv, environment,
stdout and stderr files, and dies by itself (exit code) or by the signal a test sends it. Nothing
in the server has started a thread or touched a tensor when it forks (checked: it refuses to fork
with more than one thread), so each child starts as clean as a fresh interpreter, minus the imports.

The server is a child of the test process and reaps each run, so the runs' CPU seconds count in
tests/conftest.py's figures once the server itself is reaped (:meth:`ForkServer.close`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import ENV, ROOT

_SERVER = r"""
import json, os, sys, threading
import slimectl.commands.cli as cli
# what `slimectl rl` (local launcher) imports before its first step, paid once here
import torch, megatron.core, transformers  # noqa: F401
import slimectl.backends.megatron.actor, slimectl.orchestration.loop, slimectl.orchestration.local_launcher  # noqa
import slimectl.stages.train, slimectl.stages.serve, slimectl.stages.rollout.stage  # noqa: F401
proto_in, proto_out = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
print(json.dumps({"ready": os.getpid()}), file=proto_out, flush=True)
for line in proto_in:
    job = json.loads(line)
    assert threading.active_count() == 1, threading.enumerate()  # fork only a single-threaded process
    pid = os.fork()
    if pid == 0:
        proto_in.close(); proto_out.close()
        for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                               (2, job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            f = os.open(path, mode, 0o644)
            os.dup2(f, fd)
            os.close(f)
        os.environ.clear()
        os.environ.update(job["env"])
        sys.argv = [cli.__file__, *job["argv"]]
        code = 1
        try:
            cli.main(job["argv"])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    print(json.dumps({"pid": pid}), file=proto_out, flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), file=proto_out, flush=True)
"""


class Run:
    """One `slimectl` run forked by the server: ``pid``, ``wait()`` -> return code (negative: the
    signal that ended it, as :class:`subprocess.Popen` reports it), its stdout/stderr files."""

    def __init__(self, server: "ForkServer", pid: int, stdout: Path, stderr: Path):
        self.server, self.pid, self.stdout, self.stderr = server, pid, stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.server._ready():
            self.returncode = self.server._read()["rc"]
            self.server.busy = False
        return self.returncode

    def wait(self, timeout: float = 300) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                self.kill()
                while self.poll() is None:  # reaped, so that the server takes the next run
                    time.sleep(0.05)
                raise AssertionError(f"slimectl pid {self.pid} still running after {timeout:.0f} s:\n"
                                     f"{self.stderr.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """``run(ARGV, env=..., stdout=..., stderr=...)`` starts `slimectl ARGV` as a forked child (one
    at a time) and returns its :class:`Run`; :func:`slimectl` answers like ``subprocess.run``."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**ENV, "PYTHONPATH": _pythonpath()}, cwd=ROOT)
        self.busy = False
        self.count = 0
        self._buf = b""
        assert "ready" in self._read(), "the fork server did not start"

    def _ready(self) -> bool:
        """A whole answer line is there to read (the pipe is read unbuffered, into ``_buf``)."""
        import select

        while b"\n" not in self._buf and select.select([self.proc.stdout], [], [], 0)[0]:
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                break
            self._buf += chunk
        return b"\n" in self._buf or self.proc.poll() is not None

    def _read(self) -> dict:
        while b"\n" not in self._buf:
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            assert chunk, f"the fork server died (exit {self.proc.wait()})"
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv, stdout: Path, stderr: Path, env: dict[str, str] | None = None) -> Run:
        assert not self.busy, "one run at a time"
        for f in (stdout, stderr):
            Path(f).write_text("")  # there to read from the start (the child opens them after the fork)
        job = {"argv": [str(a) for a in argv], "env": {**ENV, **(env or {})}, "stdout": str(stdout),
               "stderr": str(stderr)}
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()
        self.busy = True
        self.count += 1
        return Run(self, self._read()["pid"], Path(stdout), Path(stderr))

    def slimectl(self, *argv, out_dir: Path, env: dict[str, str] | None = None,
                 timeout: float = 600) -> subprocess.CompletedProcess:
        """`slimectl ARGV` to its end, answered like :func:`tests.helpers.slimectl`."""
        n = self.count
        out, err = Path(out_dir) / f"fork-{n}.out", Path(out_dir) / f"fork-{n}.err"
        rc = self.run(argv, out, err, env).wait(timeout)
        return subprocess.CompletedProcess(["slimectl", *map(str, argv)], rc, out.read_text(), err.read_text())

    def close(self) -> None:
        """End the server and reap it (its runs' CPU seconds count from here)."""
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _pythonpath() -> str:
    parts = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return os.pathsep.join(dict.fromkeys(parts))
