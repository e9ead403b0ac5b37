"""The fork server of the e2e tests: one interpreter pays the imports of the stages once (torch,
megatron-core, transformers, the typed config: 6-13 CPU-s a stage, 0.8 for a ``wait_for.py``
query), then forks one child per command. Each child is a real process of its own that runs
``slimectl.commands.cli.main(argv)`` (what ``python -m slimectl`` runs) or a script (``runpy``, as
``python SCRIPT`` would) with the job's argv, environment, working directory and stdin/stdout/stderr
(the file descriptors themselves travel over the server's Unix socket), and dies by itself (its exit
code) or by the signal it is sent. Nothing in the server has started a thread or touched a tensor
when it forks (it refuses to fork with more than one thread), so each child starts as clean as a
fresh interpreter, minus the imports. Each child starts a session of its own (so its own children,
torchrun and its ranks, are in its process group).

Two kinds of client, any number at once:

- the test itself: :meth:`ForkServer.run` starts ``slimectl ARGV`` and returns a :class:`Run`
  (``pid``, ``poll``/``wait`` -> the exit code, negative for the signal that ended it, as
  :class:`subprocess.Popen` reports it; ``send_signal``/``kill`` to that pid);
  :meth:`ForkServer.slimectl` runs one to its end (tests/e2e/test_fault_injection.py,
  tests/e2e/test_ray_launcher.py);
- processes of their own: the role scripts of examples/multinode/ get ``SLIMECTL``/``PYTHON`` set to
  tests/forkclient.py (:meth:`ForkServer.env`; both are documented knobs of common.sh), which
  hands the server its own argv, environment, working directory and descriptors, and exits as the
  child did (tests/e2e/test_multinode.py). A child's pid goes into the file named by
  ``SLIMECTL_FORK_PIDS`` (one per simulated host) before it runs anything, so a test's kill -9 of a
  host reaches it directly (:meth:`ForkServer.children`).

Should a client go away before its child ends (its socket closes or is reset: kill -9 of a host, a
test that dropped its :class:`Run`), the server sends the child's process group SIGKILL at once; a
client killed while it hands over its job is no error of the server's (it serves the others on). The server
is a child of the test process and reaps every child, so their CPU seconds count in
tests/conftest.py's figures once the server itself is reaped (:meth:`ForkServer.close`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLIENT = Path(__file__).resolve().parent / "forkclient.py"
SOCKET_ENV = "SLIMECTL_FORK_SOCKET"
PIDS_ENV = "SLIMECTL_FORK_PIDS"
ROOT = Path(__file__).resolve().parents[1]


def _preload(kind: str = "stages") -> None:
    """``stages``: what the stages import before their first step (the recipe's stages, `rl` and its local
    launcher), and wait_for.py's run directory. ``engine``: what the embedded engine server imports before it
    serves (torch, transformers and the model classes of the tiny families and SmolLM2)."""
    if kind == "engine":
        import torch, transformers  # noqa: E401,F401
        # what slimectl.engines.embedded.server imports, not the module itself: a child runs it as __main__
        import slimectl.engines.embedded.scheduler, slimectl.engines.embedded.model  # noqa: E401,F401
        import slimectl.engines.embedded.weights, slimectl.engines.embedded.memory, aiohttp.web  # noqa: E401,F401
        import slimectl.web.server, slimectl.engines.supervisor, slimectl.contract.signals  # noqa: E401,F401
        from transformers.models.qwen2 import modeling_qwen2  # noqa: F401
        from transformers.models.llama import modeling_llama  # noqa: F401
        from transformers.models.qwen3 import modeling_qwen3  # noqa: F401
        from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401
        from transformers.models.glm4_moe import modeling_glm4_moe  # noqa: F401
        return
    import slimectl.commands.cli  # noqa: F401
    import torch, megatron.core, transformers  # noqa: E401,F401
    import slimectl.commands.rollout, slimectl.commands.serve, slimectl.commands.sync  # noqa: E401,F401
    import slimectl.commands.train, slimectl.commands.rl, slimectl.commands._stage  # noqa: E401,F401
    import slimectl.backends.megatron.actor, slimectl.stages.train.stage  # noqa: E401,F401
    import slimectl.stages.serve, slimectl.stages.rollout.stage, slimectl.stages.sync  # noqa: E401,F401
    import slimectl.orchestration.loop, slimectl.orchestration.local_launcher  # noqa: E401,F401
    import slimectl.contract.rundir, slimectl.contract.config  # noqa: E401,F401


def _child(job: dict, fds: list[int]) -> None:
    """In the forked child: become the job's process and run it; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)  # the server's SIGCHLD wake-up is not the child's
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        pids = job["env"].get(PIDS_ENV)
        if pids:
            with open(pids, "a") as f:
                f.write(f"{os.getpid()}\n")
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        os.closerange(3, 1 << 16)  # the listener, other clients' sockets, the received copies
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        os.environ.clear()
        os.environ.update(job["env"])
        # a fresh interpreter would run slimectl's import-time defaults (MKL_CBWR) in this environment: run them
        # again, so a forked engine or stage computes as the product's own process does (MKL reads MKL_CBWR at
        # its first call, which is still to come: the server touched no tensor)
        import slimectl

        slimectl.apply_numeric_env()
        os.chdir(job["cwd"])
        # $PYTHONPATH as a fresh interpreter reads it: its entries first on sys.path, after the script's dir
        extra = [os.path.abspath(p) for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[1:1] = [p for p in extra if p not in sys.path]
        if job["mode"] == "python" and job["argv"][:1] == ["-u"]:  # python -u ...: unbuffered output
            job["argv"] = job["argv"][1:]
            sys.stdout.reconfigure(write_through=True)
            sys.stderr.reconfigure(write_through=True)
        if job["mode"] == "slimectl":
            import slimectl.commands.cli as cli

            sys.argv = [cli.__file__, *job["argv"]]
            cli.main(job["argv"])
        elif job["mode"] == "python" and job["argv"][:1] == ["-m"]:  # python -m MODULE ARGS
            import runpy

            _, module, *args = job["argv"]
            sys.argv = [module, *args]
            sys.path[0] = os.getcwd()
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        elif job["mode"] == "python":
            import runpy

            script, *args = job["argv"]
            sys.argv = [script, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            runpy.run_path(script, run_name="__main__")
        else:
            raise ValueError(f"unknown mode {job['mode']!r}")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve(path: str, log: str | None = None, kind: str = "stages") -> None:
    """The server's loop: accept clients, fork one child per job, answer its pid, then its exit code.
    With ``log``, one JSON line per child reaped: its CPU seconds, start and end (``time.monotonic``, the
    system's clock: comparable with the test process's), exit code and command."""
    import json
    import select
    import socket
    import threading

    t_start = time.monotonic()
    _preload(kind)
    if log:  # the imports, paid once: a line of their own
        import resource

        me = resource.getrusage(resource.RUSAGE_SELF)
        with open(log, "a") as f:
            f.write(json.dumps({"cpu": round(me.ru_utime + me.ru_stime, 3), "start": t_start, "end": time.monotonic(),
                                "rc": 0, "what": f"fork server: its imports ({kind})"}) + "\n")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    clients: dict[socket.socket, int] = {}  # a client's socket -> its child's pid
    by_pid: dict[int, socket.socket] = {}
    started: dict[int, tuple[float, str]] = {}  # pid -> (start, command) for the log
    # A child's exit wakes the loop at once (SIGCHLD through a self-pipe): its client hears the exit code within
    # milliseconds, as a supervisor polling the process it started would see it exit (a 50 ms poll was seen to
    # lose that race against a rollout's retries).
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        readable, _, _ = select.select([listener, sys.stdin, wake_r, *clients], [], [], 0.5)
        for r in readable:
            if r == wake_r:
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
            elif r is sys.stdin:
                if not sys.stdin.readline():  # the test closed our stdin: stop
                    for pid in by_pid:
                        _killpg(pid, signal.SIGKILL)
                    for pid in list(by_pid):
                        os.waitpid(pid, 0)
                    return
            elif r is listener:
                conn, _ = listener.accept()
                data, fds = b"", []
                try:
                    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
                    while data and not data.endswith(b"\n"):
                        more = conn.recv(1 << 16)
                        if not more:
                            break
                        data += more
                except OSError:  # reset: the client was killed while it sent its job
                    data = b""
                if len(fds) != 3 or not data.endswith(b"\n"):  # a client that died before its job was sent
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                job = json.loads(data)
                assert threading.active_count() == 1, threading.enumerate()  # fork only a single-threaded process
                pid = os.fork()
                if pid == 0:
                    _child(job, fds)
                for fd in fds:
                    os.close(fd)
                started[pid] = (time.monotonic(), " ".join([job["mode"], *job["argv"]]))
                try:
                    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                except OSError:  # the client was killed (its host's kill -9) after sending its job: so is the child
                    _kill_child(pid)
                    conn.close()
                    continue  # reaped below, no answer to send
                clients[conn] = pid
                by_pid[pid] = conn
            else:  # a client that talks after its job is sent has gone away: kill -9 its child, as its host died
                try:
                    gone = not r.recv(1)
                except OSError:  # reset rather than closed: gone all the same
                    gone = True
                if gone:
                    _kill_child(clients[r])
                    del by_pid[clients.pop(r)]  # reaped below (no answer to send)
                    r.close()
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            t0, what = started.pop(pid, (time.monotonic(), "?"))
            if log:
                with open(log, "a") as f:
                    f.write(json.dumps({"cpu": round(usage.ru_utime + usage.ru_stime, 3), "start": t0,
                                        "end": time.monotonic(), "rc": os.waitstatus_to_exitcode(status),
                                        "what": what}) + "\n")
            conn = by_pid.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                del clients[conn]
                conn.close()


def _kill_child(pid: int) -> None:
    """SIGKILL to a child's process group, and to the child itself: before its setsid() it leads no group."""
    _killpg(pid, signal.SIGKILL)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Run:
    """One command forked for the test itself: ``pid``, ``poll()``/``wait()`` -> its exit code
    (negative: the signal that ended it, as :class:`subprocess.Popen` reports it), its stdout and
    stderr files. Its socket to the server stays open until the exit code comes."""

    def __init__(self, sock, pid: int, stdout: Path, stderr: Path):
        self._sock, self.pid, self.stdout, self.stderr = sock, pid, Path(stdout), Path(stderr)
        self._buf = b""
        self.returncode: int | None = None

    def poll(self, timeout: float = 0) -> int | None:
        """The exit code once the server has reaped the child; waits at most ``timeout`` seconds for it."""
        import json
        import select

        deadline = time.monotonic() + timeout
        while self.returncode is None and b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if not select.select([self._sock], [], [], max(left, 0))[0]:
                if left <= 0:
                    return None
                continue
            chunk = self._sock.recv(4096)
            assert chunk, f"the fork server closed the connection of pid {self.pid}"
            self._buf += chunk
        if self.returncode is None:
            self.returncode = json.loads(self._buf.split(b"\n", 1)[0])["rc"]
            self._sock.close()
        return self.returncode

    def wait(self, timeout: float = 300) -> int:
        if self.poll(timeout) is None:
            self.kill()
            self.poll(60)  # reaped
            raise AssertionError(f"slimectl pid {self.pid} still running after {timeout:.0f} s:\n"
                                 f"{self.stderr.read_text(errors='replace')[-3000:]}")
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
    """The server, started by the test (one per test module): :meth:`run` and :meth:`slimectl` fork
    commands for the test; :meth:`env` is what a simulated host's environment needs to fork its own."""

    def __init__(self, env: dict[str, str] | None = None, log: Path | None = None, kind: str = "stages") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="forkserver-"))  # short: a socket path has ~100 characters
        self.socket = self.dir / "s"
        env = {**(env or os.environ), "OMP_NUM_THREADS": "1"}
        paths = [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        code = (f"from tests.forkserver import _serve; _serve({str(self.socket)!r}, {log and str(log)!r}, "
                f"{kind!r})")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, cwd=ROOT, text=True)
        line = self.proc.stdout.readline()
        assert "ready" in line, f"the fork server did not start (exit {self.proc.poll()})"
        self.count = 0  # commands run through :meth:`run`

    def run(self, argv, stdout: Path, stderr: Path, env: dict[str, str] | None = None) -> Run:
        """Start `slimectl ARGV` (stdin /dev/null, stdout and stderr to these files, truncated; the
        environment of tests.helpers.ENV plus ``env``; the working directory the repository's root)."""
        import json
        import socket

        from tests.helpers import ENV

        job = {"mode": "slimectl", "argv": [str(a) for a in argv], "env": {**ENV, **(env or {})}, "cwd": str(ROOT)}
        files = [os.open(os.devnull, os.O_RDONLY),
                 *(os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for f in (stdout, stderr))]
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(self.socket))
            socket.send_fds(sock, [json.dumps(job).encode() + b"\n"], files)
        finally:
            for fd in files:
                os.close(fd)
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = sock.recv(1)  # one byte at a time: what follows the pid line is the exit code's
            assert chunk, f"the fork server did not start {argv} (exit {self.proc.poll()})"
            answer += chunk
        self.count += 1
        return Run(sock, json.loads(answer)["pid"], stdout, stderr)

    def slimectl(self, *argv, out_dir: Path, env: dict[str, str] | None = None,
                 timeout: float = 600) -> subprocess.CompletedProcess:
        """`slimectl ARGV` to its end, answered like :func:`tests.helpers.slimectl`."""
        n = self.count
        out, err = Path(out_dir) / f"fork-{n}.out", Path(out_dir) / f"fork-{n}.err"
        rc = self.run(argv, out, err, env).wait(timeout)
        return subprocess.CompletedProcess(["slimectl", *map(str, argv)], rc, out.read_text(), err.read_text())

    def env(self, pids_file: Path) -> dict[str, str]:
        """For a process of its own (a simulated host's role script): ``$SLIMECTL``/``$PYTHON`` fork here."""
        client = f"{sys.executable} -I -S {CLIENT}"
        return {"SLIMECTL": f"{client} slimectl", "PYTHON": f"{client} python", SOCKET_ENV: str(self.socket),
                PIDS_ENV: str(pids_file)}

    def command(self, mode: str) -> str:
        """A shell command that runs ``slimectl`` (mode ``slimectl``) or ``python`` (mode ``python``) forked here,
        the server named in it (for $SLIMECTL, $SLIMECTL_EMBEDDED_PYTHON: no other variable to set)."""
        import shlex

        return " ".join(map(shlex.quote, [sys.executable, "-I", "-S", str(CLIENT), "--socket", str(self.socket), mode]))

    def children(self, pids_file: Path) -> list[int]:
        """The children forked for one host (their pids in ``pids_file``) that still run: each leads a
        process group of its own. A pid is taken only while it is this server's child, so a number the
        system gave to another process after ours exited is never signalled."""
        import psutil

        try:
            pids = [int(x) for x in Path(pids_file).read_text().split()]
        except FileNotFoundError:
            return []
        out = []
        for pid in pids:
            try:
                if psutil.Process(pid).ppid() == self.proc.pid:
                    out.append(pid)
            except psutil.NoSuchProcess:
                continue
        return out

    def close(self) -> None:
        """Stop the server (it kills -9 and reaps any child still running) and reap it: its children's CPU
        seconds count from here."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            for p in self.dir.iterdir():
                p.unlink()
            self.dir.rmdir()
