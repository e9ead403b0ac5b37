"""slimectl.engines.sglang and slimectl.engines.supervisor: argv/env construction, and supervision of stand-in SGLang servers.

No sglang here: the process tests run a small stdlib HTTP server that behaves like
``python -m sglang.launch_server`` (parses --host/--port, answers /health_generate, spawns a
grandchild, handles SIGTERM), launched through the ``launcher`` hook of the spec. The argv checks
run tests/sglang_argv_check.py (SGLang's own parser) against a fake ``sglang``.
"""

from __future__ import annotations

import logging
import os
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from slimectl.contract.errors import UsageError
from slimectl.engines.sglang.launch_spec import (SGLangLaunchSpec, build_env, build_router_argv, build_sglang_argv,
                                                 url_host)
from slimectl.engines.sglang.launcher import launch_router
from slimectl.engines.supervisor import (
    ExitedBeforeHealthy,
    HealthTimeout,
    LaunchError,
    ManagedProcess,
    ProcessSupervisor,
    _alive,
    redact_argv,
    secrets_in_argv,
)
from slimectl.web.client import http_status
from tests.helpers import free_port
from tests.sglang_argv_check import SGLANG_NOT_IMPORTABLE, check_argv_with_sglang

PY = sys.executable
TOKEN = "sk-test-4f9c2d1e0b"
ADMIN = "adm-test-77aa88bb"


# ------------------------------------------------------------------------------------------
# argv / env
# ------------------------------------------------------------------------------------------


def test_argv_minimal_exact():
    spec = SGLangLaunchSpec(model_path="/m/qwen", port=30000, python="/venv/bin/python")
    assert build_sglang_argv(spec) == [
        "/venv/bin/python", "-m", "sglang.launch_server",
        "--model-path", "/m/qwen", "--host", "127.0.0.1", "--port", "30000", "--tp-size", "1",
    ]


def test_argv_full_exact():
    spec = SGLangLaunchSpec(
        model_path="/m/qwen", host="0.0.0.0", port=30001, tp_size=2, dp_size=2, mem_fraction_static=0.7,
        dtype="bfloat16", weight_version="v3", api_key=TOKEN, admin_api_key=ADMIN, python="py",
        extra_args={"context_length": 4096, "enable_dp_attention": True, "disable_radix_cache": False,
                    "chunked_prefill_size": None, "cuda-graph-bs": [1, 2, 4], "--attention-backend": "fa3",
                    "json_model_override_args": {"b": 1, "a": "x"}},
    )
    assert build_sglang_argv(spec) == [
        "py", "-m", "sglang.launch_server",
        "--model-path", "/m/qwen", "--host", "0.0.0.0", "--port", "30001", "--tp-size", "2",
        "--dp-size", "2", "--mem-fraction-static", "0.7", "--dtype", "bfloat16", "--weight-version", "v3",
        "--api-key", TOKEN, "--admin-api-key", ADMIN,
        "--context-length", "4096", "--enable-dp-attention", "--cuda-graph-bs", "1", "2", "4",
        "--attention-backend", "fa3", "--json-model-override-args", '{"a":"x","b":1}',
    ]
    assert TOKEN not in repr(spec) and ADMIN not in repr(spec)


def test_launcher_is_injectable():
    spec = SGLangLaunchSpec(model_path="m", port=1234, launcher=[PY, "/tmp/standin.py"])
    assert build_sglang_argv(spec)[:4] == [PY, "/tmp/standin.py", "--model-path", "m"]


@pytest.mark.parametrize("key", ["model_path", "model", "host", "port", "tp_size", "tensor-parallel-size", "dp_size",
                                 "--mem-fraction-static", "dtype", "weight_version", "api_key", "admin-api-key"])
def test_duplicate_managed_flag_refused(key):
    spec = SGLangLaunchSpec(model_path="m", port=1, extra_args={key: "x"})
    with pytest.raises(ValueError) as ei:
        build_sglang_argv(spec)
    msg = str(ei.value)
    assert "\n" not in msg and repr(key) in msg and "managed flag" in msg


@pytest.mark.parametrize("kwargs, word", [
    ({"dtype": "fp8"}, "dtype"), ({"tp_size": 0}, "tp_size"), ({"port": 70000}, "port"),
    ({"mem_fraction_static": 1.5}, "mem_fraction_static"), ({"api_key": "has space"}, "api_key"),
    ({"extra_args": {"bad key!": 1}}, "bad key!"), ({"extra_args": {"a_b": 1, "a-b": 2}}, "twice"),
])
def test_bad_spec_refused_with_one_line(kwargs, word):
    spec = SGLangLaunchSpec(**{"model_path": "m", "port": 1, **kwargs})
    with pytest.raises(ValueError, match=word) as ei:
        build_sglang_argv(spec)
    assert "\n" not in str(ei.value)
    assert isinstance(ei.value, UsageError)


def test_env_cuda_visible_devices():
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "HOME": "/h"}
    env = build_env(SGLangLaunchSpec(model_path="m", port=1, gpu_ids=[2, 3]), base)
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2,3", "HOME": "/h"}
    assert base["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # not mutated
    # no gpu_ids: inherited untouched; spec.env is added
    env = build_env(SGLangLaunchSpec(model_path="m", port=1, env={"SGLANG_USE_CPU_ENGINE": "1"}), base)
    assert env == {**base, "SGLANG_USE_CPU_ENGINE": "1"}
    with pytest.raises(ValueError, match="duplicates"):
        build_env(SGLangLaunchSpec(model_path="m", port=1, gpu_ids=[1, 1]), base)
    assert "CUDA_VISIBLE_DEVICES" in build_env(SGLangLaunchSpec(model_path="m", port=1, gpu_ids=[0]))


def test_router_argv_exact():
    urls = ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    assert build_router_argv("py", "127.0.0.1", 31000, urls) == [
        "py", "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", "31000",
        "--worker-urls", *urls, "--policy", "round_robin",
    ]
    assert build_router_argv("py", "0.0.0.0", 31000, urls[:1], policy="cache_aware",
                             extra_args={"worker_startup_timeout_secs": 30, "disable_health_check": True})[-5:] == [
        "--policy", "cache_aware", "--worker-startup-timeout-secs", "30", "--disable-health-check"]
    with pytest.raises(ValueError, match="worker_urls"):
        build_router_argv("py", "h", 1, urls, extra_args={"worker_urls": ["x"]})
    with pytest.raises(ValueError, match="empty"):
        build_router_argv("py", "h", 1, [])


def test_redaction():
    spec = SGLangLaunchSpec(model_path="m", port=1, api_key=TOKEN)
    argv = build_sglang_argv(spec)
    shown = redact_argv(argv)
    assert TOKEN not in " ".join(shown) and shown[shown.index("--api-key") + 1] == "***"
    assert redact_argv(["x", f"--api-key={TOKEN}"]) == ["x", "--api-key=***"]
    assert secrets_in_argv(argv) == [TOKEN]


# ------------------------------------------------------------------------------------------
# stand-in server
# ------------------------------------------------------------------------------------------

STANDIN = textwrap.dedent(r'''
    import argparse, http.server, os, signal, subprocess, sys, threading, time
    p = argparse.ArgumentParser()
    p.add_argument("--model-path"); p.add_argument("--host"); p.add_argument("--port", type=int)
    p.add_argument("--api-key"); p.add_argument("--admin-api-key")
    p.add_argument("--healthy-after", type=float, default=0.2)
    p.add_argument("--mode", default="ok")  # ok | crash | never
    p.add_argument("--stubborn-grandchild", action="store_true")
    args, _rest = p.parse_known_args()
    shown = []
    hide = False
    for a in sys.argv:
        shown.append("***" if hide else a)
        hide = a in ("--api-key", "--admin-api-key")
    print("stand-in argv:", " ".join(shown), flush=True)
    # like SGLang's own startup dump, which prints the key in clear: the supervisor must redact it
    print(f"server_args=ServerArgs(model_path={args.model_path!r}, api_key={args.api_key!r})", flush=True)
    print("CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"), flush=True)
    if args.mode == "crash":
        time.sleep(0.1)
        print("Traceback (most recent call last):", file=sys.stderr)
        print("RuntimeError: stand-in failed to load the model", file=sys.stderr, flush=True)
        sys.exit(3)
    gc_code = ("import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
               if args.stubborn_grandchild else "import time; time.sleep(600)")
    gc = subprocess.Popen([sys.executable, "-c", gc_code])
    print(f"grandchild pid {gc.pid}", flush=True)
    t0 = time.monotonic()
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health_generate":
                ok = args.mode == "ok" and time.monotonic() - t0 >= args.healthy_after
            else:
                ok = self.path in ("/health", "/liveness")
            body = b"{}" if ok else b"not ready"
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    srv = http.server.ThreadingHTTPServer((args.host, args.port), H)
    def on_term(signum, frame):
        print("stand-in: SIGTERM, shutting down", flush=True)
        threading.Thread(target=srv.shutdown, daemon=True).start()
    signal.signal(signal.SIGTERM, on_term)
    print(f"stand-in listening on {args.host}:{args.port}", flush=True)
    srv.serve_forever(poll_interval=0.05)
    sys.exit(0)
''')


@pytest.fixture
def standin(tmp_path: Path) -> list[str]:
    script = tmp_path / "standin_sglang.py"
    script.write_text(STANDIN)
    return [PY, str(script)]


def _tree(pids: list[int]) -> list[psutil.Process]:
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs.append(p)
            procs.extend(p.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return procs


def _wait_for_grandchild(pid: int, timeout: float = 5.0) -> list[psutil.Process]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        kids = psutil.Process(pid).children(recursive=True)
        if kids:
            return kids
        time.sleep(0.02)
    raise AssertionError(f"stand-in {pid} spawned no grandchild")


def _gone(procs: list[psutil.Process]) -> bool:
    return not any(_alive(p) for p in procs)


def launch_until_healthy(specs: list[SGLangLaunchSpec], log_dir: Path, health_timeout: float, *, interval: float,
                         supervisor: ProcessSupervisor | None = None) -> list[ManagedProcess]:
    """Start a server per spec under ``supervisor`` (its argv and environment from the spec, its log
    ``log_dir/engine-<i>.log``) and wait until all answer /health_generate; on a failure the ones started are
    stopped and the error is raised."""
    sup = supervisor or ProcessSupervisor()
    started: list[ManagedProcess] = []
    try:
        for i, spec in enumerate(specs):
            url = f"http://{url_host(spec.host)}:{spec.port}"
            started.append(sup.start(f"engine-{i}", build_sglang_argv(spec), env=build_env(spec),
                                     log_path=log_dir / f"engine-{i}.log", url=url, secrets=spec.secrets()))
        sup.wait_all_healthy([p.url for p in started], timeout=health_timeout, interval=interval)
    except BaseException:
        sup.stop(names=[p.name for p in started])
        raise
    return started


def test_two_engines_healthy_logs_router_and_no_orphans(tmp_path, standin, caplog):
    caplog.set_level(logging.DEBUG, logger="slimectl")
    ports = [free_port(), free_port()]
    specs = [SGLangLaunchSpec(model_path=f"/models/m{i}", port=ports[i], launcher=standin, gpu_ids=[i],
                              api_key=TOKEN if i == 0 else None, extra_args={"healthy_after": 0.3})
             for i in range(2)]
    log_dir = tmp_path / "run" / "logs"
    with ProcessSupervisor() as sup:
        t0 = time.monotonic()
        handles = launch_until_healthy(specs, log_dir, health_timeout=15, interval=0.1, supervisor=sup)
        assert time.monotonic() - t0 < 10
        assert [h.url for h in handles] == [f"http://127.0.0.1:{p}" for p in ports]
        assert [h.log_path for h in handles] == [log_dir / "engine-0.log", log_dir / "engine-1.log"]
        for h in handles:
            assert http_status(h.url + "/health_generate", 2) == 200
            assert psutil.Process(h.pid).status() != psutil.STATUS_ZOMBIE
            assert os.getpgid(h.pid) == h.pid != os.getpgid(0)  # own process group/session
            _wait_for_grandchild(h.pid)

        router_port = free_port()
        router = launch_router(sup, [h.url for h in handles], router_port, launcher=standin,
                               extra_args={"model_path": "router"}, log_path=log_dir / "router.log",
                               health_timeout=10, interval=0.1)
        assert router.url == f"http://127.0.0.1:{router_port}"
        assert router.argv[:3] == [PY, standin[1], "--host"]
        tree = _tree([h.pid for h in handles] + [router.pid])
        assert len(tree) >= 6  # 3 stand-ins + 3 grandchildren
        sup.stop(timeout=5)
        assert _gone(tree), [p.pid for p in tree if _alive(p)]
        assert sup.processes == []

    log0 = (log_dir / "engine-0.log").read_text()
    log1 = (log_dir / "engine-1.log").read_text()
    assert "stand-in listening on 127.0.0.1:%d" % ports[0] in log0
    assert "--model-path /models/m0" in log0 and "CUDA_VISIBLE_DEVICES=0" in log0
    assert "CUDA_VISIBLE_DEVICES=1" in log1
    assert "server_args=ServerArgs(model_path='/models/m1', api_key=None)" in log1
    assert "stand-in: SIGTERM" in log0 and "stand-in: SIGTERM" in log1
    # the api key is in no log: not in our command-line header, not in the child's own dump
    assert "--api-key '***'" in log0  # slimectl's header line (shell-quoted)
    assert "--api-key ***" in log0 and "api_key='***'" in log0  # the child's own output, redacted
    assert TOKEN not in log0
    assert TOKEN not in caplog.text and "--api-key '***'" in caplog.text
    assert "grandchild pid" in (log_dir / "router.log").read_text()


def test_engine_exits_before_healthy_fails_fast_with_log_tail(tmp_path, standin):
    port = free_port()
    spec = SGLangLaunchSpec(model_path="m", port=port, launcher=standin, api_key=TOKEN, extra_args={"mode": "crash"})
    t0 = time.monotonic()
    with pytest.raises(ExitedBeforeHealthy) as ei:
        launch_until_healthy([spec], tmp_path / "logs", health_timeout=30, interval=0.1)
    assert time.monotonic() - t0 < 8
    msg = str(ei.value)
    assert "\n" not in msg
    assert f"http://127.0.0.1:{port}" in msg and "exit code 3" in msg
    assert str(tmp_path / "logs" / "engine-0.log") in msg
    assert "RuntimeError: stand-in failed to load the model" in msg
    assert TOKEN not in msg


def test_engine_never_healthy_times_out_naming_url(tmp_path, standin):
    port = free_port()
    spec = SGLangLaunchSpec(model_path="m", port=port, launcher=standin, extra_args={"mode": "never"})
    sup = ProcessSupervisor()
    t0 = time.monotonic()
    with pytest.raises(HealthTimeout) as ei:
        launch_until_healthy([spec], tmp_path / "logs", health_timeout=1.5, interval=0.1, supervisor=sup)
    assert 1.4 < time.monotonic() - t0 < 8
    msg = str(ei.value)
    assert "\n" not in msg and f"http://127.0.0.1:{port}" in msg and "/health_generate" in msg
    assert "within 1.5s" in msg and "engine-0.log" in msg and "stand-in listening" in msg
    assert sup.processes == []  # the failed launch cleaned up after itself


def test_stop_escalates_to_sigkill_for_stubborn_grandchild(tmp_path, standin):
    port = free_port()
    spec = SGLangLaunchSpec(model_path="m", port=port, launcher=standin,
                            extra_args={"stubborn_grandchild": True, "healthy_after": 0})
    with ProcessSupervisor() as sup:
        (h,) = launch_until_healthy([spec], tmp_path / "logs", health_timeout=10, interval=0.05, supervisor=sup)
        kids = _wait_for_grandchild(h.pid)
        time.sleep(0.2)  # let the grandchild install SIG_IGN
        tree = _tree([h.pid])
        t0 = time.monotonic()
        sup.stop(timeout=0.7)
        assert 0.6 < time.monotonic() - t0 < 6
        assert _gone(tree) and _gone(kids)


def test_start_missing_executable_is_one_line(tmp_path):
    with ProcessSupervisor() as sup:
        with pytest.raises(LaunchError, match="cannot start") as ei:
            sup.start("engine-0", [str(tmp_path / "nope")], log_path=tmp_path / "e.log")
        assert "\n" not in str(ei.value)


# ------------------------------------------------------------------------------------------
# check_argv_with_sglang
# ------------------------------------------------------------------------------------------


def test_check_argv_marker_when_sglang_is_absent():
    import importlib.util

    argv = build_sglang_argv(SGLangLaunchSpec(model_path="m", port=30000))
    if importlib.util.find_spec("sglang") is None:  # the normal case: slimectl's venv has no sglang
        assert check_argv_with_sglang(argv) == SGLANG_NOT_IMPORTABLE
    else:  # a venv with sglang: the real parser must accept our argv
        assert check_argv_with_sglang(argv, parse_only=True) is None
    assert check_argv_with_sglang(argv, python="/nonexistent/python") == SGLANG_NOT_IMPORTABLE


FAKE_SERVER_ARGS = textwrap.dedent('''
    import argparse, dataclasses
    @dataclasses.dataclass
    class ServerArgs:
        model_path: str
        host: str = "127.0.0.1"
        port: int = 30000
        tp_size: int = 1
        api_key: str = None
        context_length: int = None
        def __post_init__(self):
            if self.tp_size > 8:
                raise ValueError("tp_size too large for this fake")
        @staticmethod
        def add_cli_args(parser):
            parser.add_argument("--model-path", required=True)
            parser.add_argument("--host", default="127.0.0.1")
            parser.add_argument("--port", type=int, default=30000)
            parser.add_argument("--tp-size", type=int, default=1)
            parser.add_argument("--api-key")
            parser.add_argument("--context-length", type=int)
        @classmethod
        def from_cli_args(cls, args):
            return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
''')


def test_check_argv_real_code_path_with_fake_sglang(tmp_path):
    """The subprocess path, driven by a minimal fake ``sglang.srt.server_args`` on PYTHONPATH."""
    pkg = tmp_path / "fake" / "sglang" / "srt"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "server_args.py").write_text(FAKE_SERVER_ARGS)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake")}

    good = build_sglang_argv(SGLangLaunchSpec(model_path="m", port=30000, api_key=TOKEN,
                                              extra_args={"context_length": 128}))
    assert check_argv_with_sglang(good, env=env) is None
    bad = build_sglang_argv(SGLangLaunchSpec(model_path="m", port=30000, api_key=TOKEN,
                                             extra_args={"no_such_flag": True}))
    err = check_argv_with_sglang(bad, env=env)
    assert err.startswith("argparse:") and "--no-such-flag" in err and TOKEN not in err
    post = build_sglang_argv(SGLangLaunchSpec(model_path="m", port=30000, tp_size=16))
    assert check_argv_with_sglang(post, env=env) == "ServerArgs: ValueError: tp_size too large for this fake"
    assert check_argv_with_sglang(post, env=env, parse_only=True) is None

    (pkg / "server_args.py").write_text("raise ImportError('no CUDA here')\n")
    assert check_argv_with_sglang(good, env=env) == f"{SGLANG_NOT_IMPORTABLE}: ImportError: no CUDA here"
