"""Launch the sglang-router in front of SGLang servers (``serve`` starts the servers themselves), and check that
an interpreter can run it."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from slimectl.engines.sglang.launch_spec import build_router_argv, url_host
from slimectl.engines.supervisor import ProcessSupervisor


@dataclass
class SGLangRouter:
    """The launched sglang-router (its supervisor owns the process)."""

    url: str
    pid: int
    log_path: Path
    argv: list[str]
    supervisor: ProcessSupervisor | None = field(default=None, repr=False, compare=False)


def launch_router(supervisor: ProcessSupervisor, worker_urls: Sequence[str], port: int, *, host: str = "127.0.0.1",
                  python: str | None = None, policy: str = "round_robin", extra_args: Mapping[str, Any] | None = None,
                  log_path: str | Path, health_timeout: float = 120.0, interval: float = 0.5,
                  health_path: str = "/liveness", launcher: Sequence[str] | None = None,
                  env: Mapping[str, str] | None = None, wait_workers: bool = False) -> SGLangRouter:
    """Start sglang-router in front of already-healthy workers (callers do this when there is more
    than one engine and a router was asked for) and wait until ``health_path`` answers 200.
    With ``wait_workers`` it then waits until ``GET /workers`` lists every worker as healthy (the
    router registers them asynchronously: before that it answers /generate with an error).
    The router does not forward weight-update/pause endpoints: send those to each worker."""
    argv = build_router_argv(python or sys.executable, host, port, worker_urls, policy, extra_args, launcher)
    url = f"http://{url_host(host)}:{port}"
    p = supervisor.start("router", argv, env=env, log_path=log_path, url=url)
    try:
        waited = supervisor.wait_healthy(url, timeout=health_timeout, interval=interval, path=health_path)
        if wait_workers:
            wait_router_workers(url, worker_urls, timeout=max(1.0, health_timeout - waited), interval=interval)
    except BaseException:
        supervisor.stop(names=["router"])
        raise
    return SGLangRouter(url=url, pid=p.pid, log_path=p.log_path, argv=p.argv_display, supervisor=supervisor)


def router_import_problem(python: str, timeout: float = 60.0) -> str | None:
    """None when ``python`` can import ``sglang_router``; else one line saying why not."""
    import subprocess

    code = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('sglang_router') else 3)"
    try:
        res = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return f"{python} does not exist"
    except PermissionError:
        return f"{python} is not executable"
    except subprocess.TimeoutExpired:
        return f"{python} did not answer within {timeout:g}s"
    if res.returncode == 3:
        return f"sglang_router is not installed for {python}"
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or [f"exit code {res.returncode}"])[-1]
        return f"{python} failed: {tail}"
    return None


def router_workers(url: str, timeout: float = 5.0) -> list[dict[str, Any]]:
    """``GET {url}/workers``: the workers the router knows (sglang-router 0.3: ``{"workers": [...]}``)."""
    import json
    import urllib.request

    with urllib.request.urlopen(url.rstrip("/") + "/workers", timeout=timeout) as r:
        body = json.loads(r.read())
    workers = body.get("workers") if isinstance(body, dict) else body
    return [w for w in workers or [] if isinstance(w, dict)]


def wait_router_workers(url: str, worker_urls: Sequence[str], timeout: float = 60.0, interval: float = 0.5) -> float:
    """Poll ``GET /workers`` until every one of ``worker_urls`` is listed healthy; returns the seconds
    waited. Raises :class:`~slimectl.engines.supervisor.HealthTimeout` naming the missing ones."""
    import time

    from slimectl.engines.supervisor import HealthTimeout

    want = {u.rstrip("/") for u in worker_urls}
    t0 = time.monotonic()
    missing = sorted(want)
    last_error = ""
    while True:
        try:
            ready = {str(w.get("url", "")).rstrip("/") for w in router_workers(url)
                     if w.get("is_healthy", True) is not False}
            missing = sorted(want - ready)
            last_error = ""
        except (OSError, ValueError) as exc:
            last_error = f" (GET /workers: {exc})"
        if not missing:
            return time.monotonic() - t0
        if time.monotonic() - t0 >= timeout:
            raise HealthTimeout(f"router at {url}: workers {', '.join(missing)} were not registered healthy within "
                                f"{timeout:g}s{last_error}; see the router's log")
        time.sleep(interval)
