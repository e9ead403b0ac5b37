"""Child-process supervision: start with a per-process log, wait for health, stop the whole tree.

Each child runs in its own session / process group, with stdout+stderr in its log file (filtered
through a redacting pump when secrets are on its command line), is polled with ``GET URL/path``
until it answers 200, and is torn down with SIGTERM to its whole group followed by SIGKILL of
anything left (children *and* grandchildren, found with psutil). Used for the embedded engines
``serve`` starts, for real SGLang servers and for the sglang-router.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence
from urllib.parse import urlsplit

import psutil

from slimectl.contract.errors import SlimectlError
from slimectl.web.client import http_status, request_json
from slimectl.web.errors import HttpError

log = logging.getLogger("slimectl.engines.supervisor")

#: Flags whose value is a secret: never logged, redacted in process logs (SGLang's api keys).
SECRET_FLAGS = ("--api-key", "--admin-api-key")
REDACTED = "***"


class LaunchError(SlimectlError):
    """A child process (engine or router) could not start, exited before becoming healthy, or never became healthy."""


class ExitedBeforeHealthy(LaunchError):
    """The process exited before its health endpoint answered 200."""


class HealthTimeout(LaunchError):
    """The health endpoint did not answer 200 within the timeout."""


class ForeignServer(LaunchError):
    """The health endpoint answered, but not from the process we started (something else holds its port)."""


#: The environment variable through which a launcher hands an engine its nonce; the embedded
#: engine reports it as ``slimectl_nonce`` in ``/server_info`` (see :meth:`ProcessSupervisor.start`).
ENGINE_NONCE_ENV = "SLIMECTL_ENGINE_NONCE"
NONCE_FIELD = "slimectl_nonce"


# --------------------------------------------------------------------------------------------
# secrets in command lines
# --------------------------------------------------------------------------------------------


def redact_argv(argv: Sequence[str], secrets: Iterable[str] = ()) -> list[str]:
    """argv with the values of :data:`SECRET_FLAGS` (``--api-key X`` and ``--api-key=X``) and any
    occurrence of ``secrets`` replaced by ``***``."""
    secrets = [s for s in secrets if s]
    out: list[str] = []
    hide_next = False
    for a in argv:
        a = str(a)
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if a in SECRET_FLAGS:
            hide_next = True
            out.append(a)
            continue
        flag, eq, _ = a.partition("=")
        if eq and flag in SECRET_FLAGS:
            out.append(f"{flag}={REDACTED}")
            continue
        out.append(redact_text(a, secrets))
    return out


def redact_text(text: str, secrets: Iterable[str]) -> str:
    for s in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(s, REDACTED)
    return text


def secrets_in_argv(argv: Sequence[str]) -> list[str]:
    """The values given to :data:`SECRET_FLAGS` in ``argv``."""
    found = []
    for i, a in enumerate(argv):
        a = str(a)
        if a in SECRET_FLAGS and i + 1 < len(argv):
            found.append(str(argv[i + 1]))
        else:
            flag, eq, val = a.partition("=")
            if eq and flag in SECRET_FLAGS and val:
                found.append(val)
    return [s for s in found if s]



# --------------------------------------------------------------------------------------------
# process supervision
# --------------------------------------------------------------------------------------------


@dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen
    argv_display: list[str]  # redacted
    log_path: Path
    url: str | None = None
    secrets: list[str] = field(default_factory=list, repr=False)
    pump: threading.Thread | None = field(default=None, repr=False)
    nonce: str | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def returncode(self) -> int | None:
        return self.popen.poll()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def tail_lines(path: str | Path, n: int = 15, max_bytes: int = 64 * 1024) -> list[str]:
    """The last ``n`` non-empty lines of a file (reads at most the last ``max_bytes``)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    lines = [ln.rstrip() for ln in data.decode("utf-8", "replace").replace("\r", "\n").split("\n")]
    return [ln for ln in lines if ln.strip()][-n:]


def _one_line_tail(path: Path, secrets: Iterable[str], n: int = 10) -> str:
    lines = [redact_text(ln, secrets) for ln in tail_lines(path, n)]
    lines = [ln if len(ln) <= 300 else ln[:297] + "..." for ln in lines]
    return " | ".join(lines) if lines else "(log is empty)"


class ProcessSupervisor:
    """Starts child processes in their own sessions with per-process log files, waits for them to
    become healthy and tears them (and all their descendants) down. Use as a context manager::

        with ProcessSupervisor() as sup:
            p = sup.start("engine-0", argv, env=env, log_path=run_dir / "logs/engine-0.log", url=url)
            sup.wait_healthy(url, timeout=600)
            ...
    """

    def __init__(self) -> None:
        self.processes: list[ManagedProcess] = []

    # ---- start ---------------------------------------------------------------------------
    def start(self, name: str, argv: Sequence[str], *, log_path: str | Path, env: Mapping[str, str] | None = None,
              url: str | None = None, secrets: Iterable[str] = (), cwd: str | Path | None = None,
              nonce: str | None = None) -> ManagedProcess:
        """Start ``argv`` as ``name``. ``nonce``: what the server reports as ``slimectl_nonce`` in
        ``GET url/server_info`` (the launcher passed it, e.g. in :data:`ENGINE_NONCE_ENV`);
        the health wait then accepts only a server reporting it. Without one, the health wait
        accepts the server only if no other process is seen listening on the url's port."""
        argv = [str(a) for a in argv]
        secrets = sorted({*secrets, *secrets_in_argv(argv)} - {""}, key=len, reverse=True)
        display = redact_argv(argv, secrets)
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        header = f"# slimectl: starting {name}: {shlex.join(display)}"
        if env is not None and "CUDA_VISIBLE_DEVICES" in env:
            header += f" (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']})"
        logf = open(log_path, "ab", buffering=0)
        try:
            logf.write(header.encode() + b"\n")
            kwargs: dict[str, Any] = dict(stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
                                          env=dict(env) if env is not None else None,
                                          cwd=str(cwd) if cwd is not None else None, close_fds=True)
            kwargs["stdout"] = subprocess.PIPE if secrets else logf
            try:
                popen = subprocess.Popen(argv, **kwargs)
            except OSError as e:
                raise LaunchError(f"{name}: cannot start {display[0]!r}: {e.strerror or e}") from None
        except BaseException:
            logf.close()
            raise
        pump = None
        if secrets:
            pump = threading.Thread(target=_pump_redacted, args=(popen.stdout, logf, secrets),
                                    name=f"slimectl-logpump-{name}", daemon=True)
            pump.start()
        else:
            logf.close()  # the child holds its own copy
        mp = ManagedProcess(name=name, popen=popen, argv_display=display, log_path=log_path, url=url,
                            secrets=list(secrets), pump=pump, nonce=nonce)
        self.processes.append(mp)
        log.info("started %s (pid %d): %s; log: %s", name, popen.pid, shlex.join(display), log_path)
        return mp

    def find(self, url_or_name: str) -> ManagedProcess | None:
        key = url_or_name.rstrip("/")
        for p in self.processes:
            if p.name == url_or_name or (p.url and p.url.rstrip("/") == key):
                return p
        return None

    # ---- health --------------------------------------------------------------------------
    def wait_healthy(self, url: str, timeout: float = 600.0, interval: float = 1.0,
                     path: str = "/health_generate") -> float:
        """Poll ``GET {url}{path}`` until it answers 200; returns the seconds waited. Raises
        :class:`ExitedBeforeHealthy` as soon as the process started with this ``url`` exits,
        :class:`ForeignServer` when what answers is not that process (its port was taken), and
        :class:`HealthTimeout` after ``timeout`` seconds (one line each, with the log tail)."""
        return self.wait_all_healthy([url], timeout=timeout, interval=interval, path=path)

    def wait_all_healthy(self, urls: Sequence[str], timeout: float = 600.0, interval: float = 1.0,
                         path: str = "/health_generate") -> float:
        """:meth:`wait_healthy` for several servers at once: fails as soon as any of them exits."""
        t0 = time.monotonic()
        deadline = t0 + float(timeout)
        pending = [u.rstrip("/") for u in urls]
        procs = {u: self.find(u) for u in pending}
        while True:
            for u in list(pending):
                self._raise_if_exited(u, procs[u], path)
                remaining = deadline - time.monotonic()
                if http_status(u + path, timeout=max(0.5, min(10.0, remaining))) == 200:
                    self._raise_if_foreign(u, procs[u], path)
                    pending.remove(u)
                    log.info("%s is healthy after %.1fs", u, time.monotonic() - t0)
                else:
                    self._raise_if_exited(u, procs[u], path)
            if not pending:
                return time.monotonic() - t0
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                u = pending[0]
                p = procs[u]
                where = f"; log: {p.log_path}; last lines: {_one_line_tail(p.log_path, p.secrets)}" if p else ""
                raise HealthTimeout(
                    f"{p.name + ' at ' if p else ''}{u}: GET {path} did not return 200 within {timeout:g}s{where}")
            time.sleep(min(float(interval), max(0.0, remaining)))

    def wait_port_file(self, p: ManagedProcess, port_file: str | Path, timeout: float = 600.0,
                       interval: float = 0.05) -> int:
        """The port a server started with ``--port 0 --port-file PORT_FILE`` bound: the system picked it and
        the server holds it from the moment it writes the file (atomically), so no other process can take it
        between choosing and binding, as a port probed free and handed over could be taken. Fails as soon
        as the server exits."""
        port_file = Path(port_file)
        deadline = time.monotonic() + float(timeout)
        while True:
            try:
                return int(port_file.read_text())
            except (FileNotFoundError, ValueError):  # not written yet (a reader sees it whole or not at all)
                pass
            self._raise_if_exited(None, p, "")
            if time.monotonic() >= deadline:
                raise HealthTimeout(f"{p.name} did not bind a port within {timeout:g}s; log: {p.log_path}; last lines: "
                                    f"{_one_line_tail(p.log_path, p.secrets)}")
            time.sleep(interval)

    @staticmethod
    def _raise_if_exited(url: str | None, p: ManagedProcess | None, path: str) -> None:
        if p is None:
            return
        rc = p.returncode()
        if rc is None:
            return
        if p.pump is not None:
            p.pump.join(timeout=2.0)  # let the last lines reach the log
        how = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
        before = f"at {url} exited ({how}) before GET {path} returned 200" if url else f"exited ({how}) before it bound a port"
        raise ExitedBeforeHealthy(f"{p.name} {before}; log: {p.log_path}; last lines: "
                                  f"{_one_line_tail(p.log_path, p.secrets)}")

    @staticmethod
    def _raise_if_foreign(url: str, p: ManagedProcess | None, path: str) -> None:
        """Raise :class:`ForeignServer` unless the server answering at ``url`` is ``p``."""
        if p is None:
            return
        why = _foreign_reason(url, p)
        if why is None:
            return
        port = urlsplit(url).port
        raise ForeignServer(f"{p.name} at {url}: GET {path} was answered by another server, not the process "
                            f"started here (pid {p.pid}): {why}; port {port} is taken by something else: pick another "
                            f"port, or let one be chosen (serve: omit --port); log: {p.log_path}")

    # ---- stop ----------------------------------------------------------------------------
    def stop(self, timeout: float = 10.0, names: Iterable[str] | None = None) -> None:
        """SIGTERM every process group, wait up to ``timeout`` s for the processes *and* all their
        descendants (snapshotted with psutil, so escapees from the group count too), then SIGKILL
        whatever is left. Idempotent."""
        wanted = set(names) if names is not None else None
        procs = [p for p in self.processes if wanted is None or p.name in wanted]
        if not procs:
            return
        tracked = self._snapshot(procs, groups=True)
        for p in procs:
            if p.returncode() is None:
                _killpg(p.pid, signal.SIGTERM)
        for d in tracked:  # descendants that left the group (setsid) get SIGTERM too
            _signal_proc(d, signal.SIGTERM, skip_pgids={p.pid for p in procs})
        deadline = time.monotonic() + float(timeout)
        while time.monotonic() < deadline:
            tracked |= self._snapshot(procs)
            if all(p.returncode() is not None for p in procs) and not any(_alive(d) for d in tracked):
                break
            time.sleep(0.05)
        else:
            tracked |= self._snapshot(procs, groups=True)
            left = [p.name for p in procs if p.returncode() is None]
            log.warning("escalating to SIGKILL after %.0fs: %s still running (+%d descendants)", timeout,
                        ", ".join(left) or "no managed process", sum(_alive(d) for d in tracked))
            for p in procs:
                _killpg(p.pid, signal.SIGKILL)
            for d in tracked:
                _signal_proc(d, signal.SIGKILL)
        for p in procs:
            try:
                p.popen.wait(timeout=5.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILLed above
                log.error("%s (pid %d) did not exit after SIGKILL", p.name, p.pid)
        end = time.monotonic() + 5.0
        while any(_alive(d) for d in tracked) and time.monotonic() < end:
            time.sleep(0.05)
        for p in procs:
            if p.pump is not None:
                p.pump.join(timeout=2.0)
            if p.popen.stdout is not None:
                try:
                    p.popen.stdout.close()
                except OSError:
                    pass
        survivors = [d.pid for d in tracked if _alive(d)]
        if survivors:
            log.error("processes still alive after stop: %s", survivors)
        for p in procs:
            log.info("stopped %s (pid %d, exit %s)", p.name, p.pid, p.returncode())
        self.processes = [p for p in self.processes if p not in procs]

    def _snapshot(self, procs: Iterable[ManagedProcess], groups: bool = False) -> set[psutil.Process]:
        """Live descendants of ``procs``; with ``groups``, also every member of their process groups
        (catches grandchildren already reparented to init because their parent died)."""
        procs = list(procs)
        out: set[psutil.Process] = set()
        for p in procs:
            if p.returncode() is None:  # not reaped yet, so the pid is still this child's (no reuse)
                out.update(_descendants(p.pid))
        if groups:  # a process group id is never reused while a member is alive
            out.update(_group_members({p.pid for p in procs}))
        return out

    def __enter__(self) -> "ProcessSupervisor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()



def _foreign_reason(url: str, p: ManagedProcess) -> str | None:
    """None when the server at ``url`` is ``p`` (or it cannot be told); else why it is not.

    With a nonce, the server must report it in ``/server_info`` (``/get_server_info`` on a server
    without the current name). Without one (real SGLang
    cannot report ours), the listeners on the url's port are looked up: one owned by ``p`` or a
    descendant is ours; one owned only by other processes we can see is foreign; when the owner
    cannot be seen (another user's process, a container's port forwarder) it is accepted."""
    if p.nonce is not None:
        try:
            try:
                info = request_json("GET", url, path="/server_info", timeout=10.0, what="engine")
            except HttpError as exc:
                if exc.status != 404:
                    raise
                info = request_json("GET", url, path="/get_server_info", timeout=10.0, what="engine")
        except HttpError as exc:
            return f"it does not report our nonce ({exc})"
        got = info.get(NONCE_FIELD) if isinstance(info, dict) else None
        if got == p.nonce:
            return None
        return "it reports no instance nonce" if got is None else "it reports another engine's instance nonce"
    port = urlsplit(url).port
    if port is None:
        return None
    ours = {p.pid, *(d.pid for d in _descendants(p.pid))}
    try:
        listeners = {c.pid for c in psutil.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}
    except (psutil.Error, OSError):
        return None
    if listeners & ours or None in listeners or not listeners:
        return None
    return f"pid {', '.join(map(str, sorted(listeners)))} listens there"


def _group_members(pgids: set[int]) -> list[psutil.Process]:
    me = os.getpid()
    out = []
    for p in psutil.process_iter():
        try:
            if p.pid != me and os.getpgid(p.pid) in pgids:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return out


def kill_tree(pid: int, create_time: float | None = None) -> None:
    """SIGKILL what is left of a process a supervisor elsewhere started (in its own session, so its group):
    the process while it is still that one (``create_time``), its descendants, and every member of its process
    group (SGLang's scheduler and detokenizer outlive a ``kill -9`` of their server; a group id is not reused
    while a member lives). For a process whose supervisor died with it (a killed Ray actor's engine)."""
    from slimectl.contract.rundir.atomic import process_alive

    if process_alive(pid, create_time):
        tree = _descendants(pid)
        _killpg(pid, signal.SIGKILL)
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for p in tree:
            _signal_proc(p, signal.SIGKILL)
    elif not psutil.pid_exists(pid):
        for p in _group_members({pid}):
            _signal_proc(p, signal.SIGKILL)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_proc(p: psutil.Process, sig: int, skip_pgids: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    try:
        if skip_pgids and os.getpgid(p.pid) in skip_pgids:
            return  # already signalled through its group
        if _alive(p):
            p.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError, PermissionError):
        pass


def _pump_redacted(src: Any, dst: Any, secrets: Sequence[str]) -> None:
    enc = [(s.encode(), REDACTED.encode()) for s in secrets]
    try:
        for line in iter(src.readline, b""):
            for s, r in enc:
                line = line.replace(s, r)
            try:
                dst.write(line)
            except OSError:
                pass
    except (OSError, ValueError):
        pass
    finally:
        try:
            dst.close()
        except OSError:
            pass
