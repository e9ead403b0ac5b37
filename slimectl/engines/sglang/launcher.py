"""Launch and supervise real SGLang servers (and the sglang-router) as child processes.

This is the GPU production path: each engine is ``python -m sglang.launch_server ...`` in its own
session/process group, with stdout+stderr in a per-engine log file, polled with
``GET /health_generate`` until it answers 200, and torn down with SIGTERM to the whole group
followed by SIGKILL of anything left (children *and* grandchildren).

Nothing here imports sglang: the argv is built as plain strings, and :func:`check_argv_with_sglang`
validates it with SGLang's own argparse in a *subprocess* of the interpreter that has sglang.

Flags and semantics this module relies on (SGLang 0.5.x, ``python/sglang/srt/server_args.py``):

* ``--model-path --host --port --tp-size --dp-size --mem-fraction-static --dtype --weight-version``
  (``--dtype`` choices: auto, half, float16, bfloat16, float, float32).
* ``--api-key`` protects every endpoint except ``/health*``, ``/ready*`` and ``/metrics*``
  (Bearer token or ``x-api-key`` header). ``--admin-api-key`` protects the management endpoints
  (``/update_weights_from_*``, ...); when it is set those endpoints accept *only* the admin key,
  when it is not they accept the api key (``python/sglang/srt/utils/auth.py``). The health check
  therefore never needs a token. :func:`control_token` picks the right one for weight updates.
* Secrets are passed on the command line (that is how SGLang takes them), are shown as ``***`` in
  every command line this module logs, and are replaced by ``***`` in the engine log files (SGLang
  prints ``server_args=ServerArgs(... api_key='...')`` at startup, so its output is filtered
  through a redacting pump whenever a secret is involved).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import psutil

from slimectl.contract.errors import SlimectlError, UsageError

log = logging.getLogger("slimectl.engines.sglang")

SGLANG_SERVER_MODULE = "sglang.launch_server"
SGLANG_ROUTER_MODULE = "sglang_router.launch_router"
#: What :func:`check_argv_with_sglang` returns when the interpreter cannot import sglang.
SGLANG_NOT_IMPORTABLE = "sglang not importable"
#: SGLang's ``--dtype`` choices (``ServerArgs.dtype``).
SGLANG_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
#: Flags whose value is a secret: never logged, redacted in engine logs.
SECRET_FLAGS = ("--api-key", "--admin-api-key")
REDACTED = "***"

# extra_args keys that the spec owns (field name -> flag); aliases SGLang accepts for them too.
_MANAGED_SERVER_KEYS = {
    "model_path": "--model-path",
    "model": "--model-path",  # SGLang alias of --model-path
    "host": "--host",
    "port": "--port",
    "tp_size": "--tp-size",
    "tensor_parallel_size": "--tp-size",
    "dp_size": "--dp-size",
    "data_parallel_size": "--dp-size",
    "mem_fraction_static": "--mem-fraction-static",
    "dtype": "--dtype",
    "weight_version": "--weight-version",
    "api_key": "--api-key",
    "admin_api_key": "--admin-api-key",
}
_MANAGED_ROUTER_KEYS = {"host": "--host", "port": "--port", "worker_urls": "--worker-urls", "policy": "--policy"}
_KEY_RE = re.compile(r"^[a-z0-9][a-z0-9_]*$")


class SGLangArgError(UsageError, ValueError):
    """A launch spec or pass-through argument is invalid (a ValueError, and a UsageError for the CLI)."""


class EngineLaunchError(SlimectlError):
    """An engine (or router) process exited before becoming healthy, or never became healthy."""


class EngineExited(EngineLaunchError):
    """The process exited before its health endpoint answered 200."""


class EngineHealthTimeout(EngineLaunchError):
    """The health endpoint did not answer 200 within the timeout."""


# --------------------------------------------------------------------------------------------
# argv / env construction
# --------------------------------------------------------------------------------------------


@dataclass
class SGLangLaunchSpec:
    """One SGLang server. ``launcher`` replaces ``[python, "-m", "sglang.launch_server"]`` (tests)."""

    model_path: str
    port: int
    host: str = "127.0.0.1"
    tp_size: int = 1
    dp_size: int = 1
    mem_fraction_static: float | None = None
    dtype: str | None = None
    gpu_ids: list[int] = field(default_factory=list)
    weight_version: str | None = None
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)
    extra_args: dict[str, Any] = field(default_factory=dict)
    python: str = field(default_factory=lambda: sys.executable)
    launcher: list[str] | None = None
    log_path: str | Path | None = None
    #: extra environment variables for this engine (e.g. ``SGLANG_USE_CPU_ENGINE=1`` on CPU)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}"

    def secrets(self) -> list[str]:
        return [s for s in (self.api_key, self.admin_api_key) if s]


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _norm_key(key: str) -> str:
    k = str(key).strip().lstrip("-").replace("-", "_").lower()
    if not _KEY_RE.match(k):
        raise SGLangArgError(f"extra arg {key!r}: not a flag name (use e.g. 'context_length' for --context-length)")
    return k


def translate_extra_args(extra: Mapping[str, Any] | None, managed: Mapping[str, str] = _MANAGED_SERVER_KEYS,
                         what: str = "sglang") -> list[str]:
    """``{"context_length": 4096, "enable_dp_attention": True}`` -> ``["--context-length", "4096",
    "--enable-dp-attention"]``. False/None (or an empty list) drop the flag; a list/tuple gives
    ``--flag v1 v2 ...`` (SGLang's list flags are ``nargs='+'``: repeating the flag would keep only
    the last value); a dict is passed as JSON. Keys the launcher manages itself are refused."""
    out: list[str] = []
    seen: dict[str, str] = {}
    for key, value in (extra or {}).items():
        k = _norm_key(key)
        if k in managed:
            raise SGLangArgError(
                f"{what} extra arg {key!r} duplicates the managed flag {managed[k]}: set it on the launch spec instead")
        if k in seen:
            raise SGLangArgError(f"{what} extra arg {key!r} given twice (also as {seen[k]!r})")
        seen[k] = str(key)
        flag = "--" + k.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            if not value:
                continue
            out.append(flag)
            out.extend(_scalar(v, key) for v in value)
        elif isinstance(value, dict):
            out += [flag, json.dumps(value, separators=(",", ":"), sort_keys=True)]
        else:
            out += [flag, _scalar(value, key)]
    return out


def _scalar(v: Any, key: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float, str, Path)):
        return str(v)
    if isinstance(v, dict):
        return json.dumps(v, separators=(",", ":"), sort_keys=True)
    raise SGLangArgError(f"extra arg {key!r}: unsupported value type {type(v).__name__}")


def _check_spec(spec: SGLangLaunchSpec) -> None:
    if not str(spec.model_path):
        raise SGLangArgError("sglang spec: model_path is empty")
    if not isinstance(spec.port, int) or isinstance(spec.port, bool) or not 0 < spec.port < 65536:
        raise SGLangArgError(f"sglang spec: port {spec.port!r} is not in 1..65535")
    for name in ("tp_size", "dp_size"):
        v = getattr(spec, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SGLangArgError(f"sglang spec: {name} {v!r} must be an integer >= 1")
    if spec.mem_fraction_static is not None and not 0.0 < float(spec.mem_fraction_static) <= 1.0:
        raise SGLangArgError(f"sglang spec: mem_fraction_static {spec.mem_fraction_static!r} must be in (0, 1]")
    if spec.dtype is not None and spec.dtype not in SGLANG_DTYPES:
        raise SGLangArgError(f"sglang spec: dtype {spec.dtype!r} is not one of {', '.join(SGLANG_DTYPES)}")
    for name in ("api_key", "admin_api_key"):
        v = getattr(spec, name)
        if v is not None and (not isinstance(v, str) or not v or any(c.isspace() for c in v)):
            raise SGLangArgError(f"sglang spec: {name} must be a non-empty string without whitespace")


def build_sglang_argv(spec: SGLangLaunchSpec) -> list[str]:
    """The exact argv for one SGLang server (contains the api keys in clear: log :func:`redact_argv`)."""
    _check_spec(spec)
    launcher = list(spec.launcher) if spec.launcher else [spec.python, "-m", SGLANG_SERVER_MODULE]
    argv = launcher + [
        "--model-path", str(spec.model_path),
        "--host", spec.host,
        "--port", str(spec.port),
        "--tp-size", str(spec.tp_size),
    ]
    if spec.dp_size != 1:
        argv += ["--dp-size", str(spec.dp_size)]
    if spec.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(float(spec.mem_fraction_static))]
    if spec.dtype is not None:
        argv += ["--dtype", spec.dtype]
    if spec.weight_version is not None:
        argv += ["--weight-version", str(spec.weight_version)]
    if spec.api_key:
        argv += ["--api-key", spec.api_key]
    if spec.admin_api_key:
        argv += ["--admin-api-key", spec.admin_api_key]
    return argv + translate_extra_args(spec.extra_args)


def build_env(spec: SGLangLaunchSpec, base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base_env`` (default: this process's environment) plus ``spec.env``, with
    ``CUDA_VISIBLE_DEVICES`` set from ``spec.gpu_ids`` when they are given (otherwise inherited)."""
    env = dict(os.environ if base_env is None else base_env)
    env.update({str(k): str(v) for k, v in (spec.env or {}).items()})
    if spec.gpu_ids:
        ids = list(spec.gpu_ids)
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
            raise SGLangArgError(f"sglang spec: gpu_ids {ids!r} must be non-negative integers")
        if len(set(ids)) != len(ids):
            raise SGLangArgError(f"sglang spec: gpu_ids {ids!r} contain duplicates")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in ids)
    return env


def build_router_argv(python: str, host: str, port: int, worker_urls: Sequence[str], policy: str = "round_robin",
                      extra_args: Mapping[str, Any] | None = None, launcher: Sequence[str] | None = None) -> list[str]:
    """``python -m sglang_router.launch_router --host H --port P --worker-urls URL... --policy POLICY``."""
    urls = [str(u) for u in worker_urls]
    if not urls:
        raise SGLangArgError("router: worker_urls is empty")
    if not policy:
        raise SGLangArgError("router: policy is empty")
    prefix = list(launcher) if launcher else [python, "-m", SGLANG_ROUTER_MODULE]
    return prefix + ["--host", host, "--port", str(port), "--worker-urls", *urls, "--policy", policy] + \
        translate_extra_args(extra_args, _MANAGED_ROUTER_KEYS, what="router")


def control_token(spec: SGLangLaunchSpec) -> str | None:
    """The token for SGLang's admin-optional endpoints (weight updates, pause, ...): the admin key
    when set (the api key is then refused there), otherwise the api key, otherwise None."""
    return spec.admin_api_key or spec.api_key or None


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


_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_status(url: str, timeout: float) -> int | None:
    """GET ``url`` without any proxy; the HTTP status, or None when nothing answered."""
    try:
        with _NO_PROXY_OPENER.open(urllib.request.Request(url, method="GET"), timeout=timeout) as r:
            r.read(1 << 16)
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError, ValueError):
        return None


class ProcessSupervisor:
    """Starts child processes in their own sessions with per-process log files, waits for them to
    become healthy and tears them (and all their descendants) down. Use as a context manager::

        with ProcessSupervisor() as sup, sup.install_signal_handlers():
            p = sup.start("engine-0", argv, env=env, log_path=run_dir / "logs/engine-0.log", url=url)
            sup.wait_healthy(url, timeout=600)
            ...
    """

    def __init__(self) -> None:
        self.processes: list[ManagedProcess] = []
        self._prev_handlers: dict[int, Any] = {}

    # ---- start ---------------------------------------------------------------------------
    def start(self, name: str, argv: Sequence[str], *, log_path: str | Path, env: Mapping[str, str] | None = None,
              url: str | None = None, secrets: Iterable[str] = (), cwd: str | Path | None = None) -> ManagedProcess:
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
                raise EngineLaunchError(f"{name}: cannot start {display[0]!r}: {e.strerror or e}") from None
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
                            secrets=list(secrets), pump=pump)
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
        :class:`EngineExited` as soon as the process started with this ``url`` exits, and
        :class:`EngineHealthTimeout` after ``timeout`` seconds (one line each, with the log tail)."""
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
                raise EngineHealthTimeout(
                    f"{p.name + ' at ' if p else ''}{u}: GET {path} did not return 200 within {timeout:g}s{where}")
            time.sleep(min(float(interval), max(0.0, remaining)))

    @staticmethod
    def _raise_if_exited(url: str, p: ManagedProcess | None, path: str) -> None:
        if p is None:
            return
        rc = p.returncode()
        if rc is None:
            return
        if p.pump is not None:
            p.pump.join(timeout=2.0)  # let the last lines reach the log
        how = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
        raise EngineExited(f"{p.name} at {url} exited ({how}) before GET {path} returned 200; "
                           f"log: {p.log_path}; last lines: {_one_line_tail(p.log_path, p.secrets)}")

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

    # ---- signals -------------------------------------------------------------------------
    def install_signal_handlers(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)) -> "_SignalGuard":
        """Make SIGTERM/SIGINT in this (main-thread) process stop the children first, then run the
        previous handler (default SIGINT -> KeyboardInterrupt; default SIGTERM -> SystemExit(143)).
        Signals set to SIG_IGN are left alone. Must be called from the main thread. Returns a
        guard: ``restore()`` (or leaving its ``with`` block) puts the previous handlers back."""
        for sig in signals:
            if sig in self._prev_handlers or signal.getsignal(sig) == signal.SIG_IGN:
                continue  # already ours, or deliberately ignored (nohup, background job): leave it
            self._prev_handlers[sig] = signal.signal(sig, self._on_signal)
        return _SignalGuard(self)

    def restore_signal_handlers(self) -> None:
        while self._prev_handlers:
            sig, prev = self._prev_handlers.popitem()
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: Any) -> None:
        prev = self._prev_handlers.get(signum)
        log.warning("received %s: stopping %d child process(es)", signal.Signals(signum).name, len(self.processes))
        self.stop()
        self.restore_signal_handlers()
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_IGN:
            return
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            raise SystemExit(128 + signum)

    def __enter__(self) -> "ProcessSupervisor":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop()
        finally:
            self.restore_signal_handlers()


class _SignalGuard:
    def __init__(self, sup: ProcessSupervisor) -> None:
        self._sup = sup

    def restore(self) -> None:
        self._sup.restore_signal_handlers()

    def __enter__(self) -> "_SignalGuard":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


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


# --------------------------------------------------------------------------------------------
# engines and router
# --------------------------------------------------------------------------------------------


@dataclass
class EngineHandle:
    url: str
    pid: int
    log_path: Path
    spec: SGLangLaunchSpec
    name: str = ""
    supervisor: ProcessSupervisor | None = field(default=None, repr=False, compare=False)


def launch_sglang_engines(specs: Sequence[SGLangLaunchSpec], run_log_dir: str | Path, health_timeout: float = 600.0,
                          *, interval: float = 1.0, supervisor: ProcessSupervisor | None = None,
                          base_env: Mapping[str, str] | None = None) -> list[EngineHandle]:
    """Start every engine (``run_log_dir/engine-<i>.log`` unless ``spec.log_path``), then wait until
    all answer ``/health_generate``. On failure the engines started here are stopped and the error
    is raised. Pass ``supervisor`` to own their lifetime; otherwise a new one is created and is
    available as ``handle.supervisor`` (call its ``stop()``)."""
    if not specs:
        raise SGLangArgError("no sglang engines to launch")
    ports = [(s.host, s.port) for s in specs]
    if len(set(ports)) != len(ports):
        raise SGLangArgError(f"sglang specs: duplicate host:port in {', '.join(f'{h}:{p}' for h, p in ports)}")
    sup = supervisor or ProcessSupervisor()
    argvs = [build_sglang_argv(s) for s in specs]  # validate every spec before starting anything
    envs = [build_env(s, base_env) for s in specs]
    started: list[ManagedProcess] = []
    try:
        for i, (spec, argv, env) in enumerate(zip(specs, argvs, envs)):
            log_path = Path(spec.log_path) if spec.log_path else Path(run_log_dir) / f"engine-{i}.log"
            started.append(sup.start(f"engine-{i}", argv, env=env, log_path=log_path, url=spec.url,
                                     secrets=spec.secrets()))
        sup.wait_all_healthy([p.url for p in started if p.url], timeout=health_timeout, interval=interval)
    except BaseException:
        sup.stop(names=[p.name for p in started])
        raise
    return [EngineHandle(url=p.url or "", pid=p.pid, log_path=p.log_path, spec=s, name=p.name, supervisor=sup)
            for p, s in zip(started, specs)]


@dataclass
class RouterHandle:
    url: str
    pid: int
    log_path: Path
    argv: list[str]
    supervisor: ProcessSupervisor | None = field(default=None, repr=False, compare=False)


def launch_router(supervisor: ProcessSupervisor, worker_urls: Sequence[str], port: int, *, host: str = "127.0.0.1",
                  python: str | None = None, policy: str = "round_robin", extra_args: Mapping[str, Any] | None = None,
                  log_path: str | Path, health_timeout: float = 120.0, interval: float = 0.5,
                  health_path: str = "/liveness", launcher: Sequence[str] | None = None,
                  env: Mapping[str, str] | None = None) -> RouterHandle:
    """Start sglang-router in front of already-healthy workers (callers do this when there is more
    than one engine and a router was asked for) and wait until ``health_path`` answers 200.
    The router does not forward weight-update/pause endpoints: send those to each worker."""
    argv = build_router_argv(python or sys.executable, host, port, worker_urls, policy, extra_args, launcher)
    url = f"http://{_url_host(host)}:{port}"
    p = supervisor.start("router", argv, env=env, log_path=log_path, url=url)
    try:
        supervisor.wait_healthy(url, timeout=health_timeout, interval=interval, path=health_path)
    except BaseException:
        supervisor.stop(names=["router"])
        raise
    return RouterHandle(url=url, pid=p.pid, log_path=p.log_path, argv=p.argv_display, supervisor=supervisor)


# --------------------------------------------------------------------------------------------
# argv check against SGLang's own parser
# --------------------------------------------------------------------------------------------

_CHECK_SCRIPT = r"""
import argparse, json, sys
req = json.load(sys.stdin)
def done(ok, error=None):
    sys.stdout.write("\n@@SLIMECTL@@" + json.dumps({"ok": ok, "error": error}) + "\n")
    sys.stdout.flush()
    sys.exit(0)
try:
    from sglang.srt.server_args import ServerArgs
except BaseException as e:
    done(False, "@@IMPORT@@%s: %s" % (type(e).__name__, e))
class _Err(Exception):
    pass
class P(argparse.ArgumentParser):
    def error(self, message):
        raise _Err(message)
p = P(prog="sglang.launch_server")
try:
    ServerArgs.add_cli_args(p)
    ns = p.parse_args(req["args"])
except _Err as e:
    done(False, "argparse: %s" % e)
except SystemExit as e:
    done(False, "argparse exited with %s" % e.code)
if not req["parse_only"]:
    try:
        ServerArgs.from_cli_args(ns)
    except BaseException as e:
        done(False, "ServerArgs: %s: %s" % (type(e).__name__, e))
done(True)
"""


def _server_args_part(argv: Sequence[str]) -> list[str]:
    argv = [str(a) for a in argv]
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1] == SGLANG_SERVER_MODULE:
            return argv[i + 2:]
    if not argv or argv[0].startswith("--"):
        return argv
    raise SGLangArgError(f"argv does not run '-m {SGLANG_SERVER_MODULE}' and does not start with a flag: "
                         f"{shlex.join(redact_argv(argv[:4]))} ...")


def check_argv_with_sglang(argv: Sequence[str], python: str | None = None, *, timeout: float = 300.0,
                           parse_only: bool = False, env: Mapping[str, str] | None = None) -> str | None:
    """Validate a server argv with SGLang's own ``ServerArgs.add_cli_args`` + ``parse_args`` and
    (unless ``parse_only``) ``ServerArgs.from_cli_args`` -- what ``prepare_server_args`` does in
    ``python -m sglang.launch_server`` -- in a subprocess of ``python`` (default: this interpreter).

    Returns None when SGLang accepts it, :data:`SGLANG_NOT_IMPORTABLE` when ``python`` has no
    ``sglang`` package (or does not run), ``"sglang not importable: <why>"`` when sglang is there but
    ``sglang.srt.server_args`` fails to import, and otherwise the (redacted, one-line) error text.
    ``from_cli_args`` runs ``ServerArgs.__post_init__``, which may inspect the model path and the
    local devices: use ``parse_only=True`` on a machine that is not the target one."""
    args = _server_args_part(argv)
    secrets = secrets_in_argv(args)
    py = python or sys.executable
    run_env = dict(os.environ if env is None else env)
    try:
        probe = subprocess.run([py, "-c", "import importlib.util,sys; "
                                "sys.exit(0 if importlib.util.find_spec('sglang') else 3)"],
                               env=run_env, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return SGLANG_NOT_IMPORTABLE
    if probe.returncode != 0:
        return SGLANG_NOT_IMPORTABLE
    try:
        # args go over stdin, so the api key never shows up in this checker's command line
        res = subprocess.run([py, "-c", _CHECK_SCRIPT], input=json.dumps({"args": args, "parse_only": parse_only}),
                             env=run_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"sglang argv check timed out after {timeout:g}s"
    marker = "\n@@SLIMECTL@@"
    out = "\n" + res.stdout
    if marker not in out:
        tail = " | ".join(ln for ln in (res.stderr or res.stdout).strip().splitlines()[-5:])
        return redact_text(f"sglang argv check crashed (exit {res.returncode}): {tail}", secrets)
    verdict = json.loads(out.rsplit(marker, 1)[1].strip().splitlines()[0])
    if verdict["ok"]:
        return None
    err = str(verdict["error"])
    if err.startswith("@@IMPORT@@"):
        return f"{SGLANG_NOT_IMPORTABLE}: {redact_text(err[len('@@IMPORT@@'):], secrets)}".splitlines()[0]
    return " ".join(redact_text(err, secrets).split())


__all__ = [
    "SGLANG_NOT_IMPORTABLE", "SGLANG_DTYPES", "SECRET_FLAGS", "SGLangLaunchSpec", "SGLangArgError",
    "EngineLaunchError", "EngineExited", "EngineHealthTimeout", "build_sglang_argv", "build_env",
    "build_router_argv", "translate_extra_args", "redact_argv", "control_token", "ProcessSupervisor",
    "ManagedProcess", "EngineHandle", "RouterHandle", "launch_sglang_engines", "launch_router",
    "check_argv_with_sglang", "tail_lines", "http_status",
]
