"""``slimectl serve``: start (or attach to) inference engines and record them in the run directory.

Three backends share one shape: each engine is an HTTP server speaking SGLang's protocol,
supervised as a child process (its own session, its log in ``RUN/logs/engine-N.log``),
registered in ``RUN/engines/`` once ``/health_generate`` answers, and unregistered and stopped
(no orphans) when ``serve`` exits.

- ``embedded``: ``python -m slimectl.engines.embedded.server`` (our CPU engine; the default; the
  interpreter command from ``$SLIMECTL_EMBEDDED_PYTHON`` when set, e.g. a ``numactl`` prefix).
- ``sglang``: ``python -m sglang.launch_server`` (real SGLang; GPUs).
- ``external``: servers started elsewhere (``--engine-url``); only health-checked and registered.

Launched engines start at the newest READY ``weights/N`` of the run (what train and export
publish, what the disk sync hands to engines) and are recorded at weight version N; with no
published weights they start from ``model.path`` at version 0. ``weight_version`` picks another
(``"initial"``: ``model.path``). Launched engines get ``engine.env`` on top of serve's own
environment (e.g. ``SGLANG_USE_CPU_ENGINE=1`` for SGLang on CPU). A fixed ``engine.port`` is checked before anything is launched,
without one an embedded engine binds a port the system picks (``--port 0``, reported in a port file), an SGLang
server one probed free just before it starts;
and each launched engine must prove it is the one we started (a nonce it reports, or for real
SGLang that our process listens on the port) before it is called healthy.

With ``engine.router: true`` serve then starts sglang-router (``python -m sglang_router.launch_router``,
from ``engine.router_python``) in front of the engines it launched, waits until ``GET /workers``
lists them all healthy, and records it in ``RUN/engines/routers/`` (its log: ``RUN/logs/router.log``).
Rollout sends ``/generate`` through it; weight updates, pause, continue and abort go to each
engine (the router does not forward them). It is stopped and unrecorded with the engines.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from secrets import token_hex
from typing import Literal, Union

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.contract.faults import fault_point
from slimectl.contract.net import free_port
from slimectl.contract.rundir import EngineRecord, RunDir
from slimectl.contract.rundir.registry import this_process
from slimectl.engines.supervisor import ENGINE_NONCE_ENV
from slimectl.contract.signals import set_on_signals
from slimectl.weight_formats import weight_format

log = logging.getLogger("slimectl.serve")

INITIAL_WEIGHT_VERSION = "0"

#: What ``serve --weight-version``/``--initial`` asks for: None (the newest published weights),
#: a version N, or ``"initial"`` (model.path at version 0).
WeightChoice = Union[int, Literal["initial"], None]


def _how_checked(verified_against_weights: bool, read_back: bool) -> str:
    """How an engine started again was checked, as its heal's log line says it."""
    if not verified_against_weights:
        return "its version checked"  # a frozen group: its model, not weights/N
    return "checked" if read_back else "its version checked; its weights could not be read back"


def port_in_use(host: str, port: int) -> bool:
    """Whether something already listens on ``host:port`` (bound the way our servers bind: with
    SO_REUSEADDR, so a TIME_WAIT left by an earlier engine does not count). Other bind errors
    (an address not on this machine, a privileged port) are left for the engine to report."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host or "0.0.0.0", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _url(host: str, port: int) -> str:
    h = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return f"http://[{h}]:{port}" if ":" in h else f"http://{h}:{port}"


_WILDCARDS = ("0.0.0.0", "::", "")


def advertised_host(bind: str, advertise: str | None = None) -> str:
    """The address recorded for engines bound to ``bind``: what rollout and sync on *other*
    hosts connect to. ``engine.advertise_host`` wins; a specific bind address is itself; for a
    wildcard bind it is this machine's address on its default route (a bind to 0.0.0.0 recorded
    as 127.0.0.1 would send every other host to its own loopback)."""
    if advertise:
        return advertise
    if bind not in _WILDCARDS:
        return bind
    addr = _default_route_address()
    if addr is None:
        log.warning("engines bind %s but this machine's address could not be found; recording 127.0.0.1, "
                    "which only this host can reach: set engine.advertise_host", bind or "all interfaces")
        return "127.0.0.1"
    return addr


def _default_route_address() -> str | None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # a UDP connect sends nothing: it only picks the route
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def embedded_threads(configured: int | None, env: dict[str, str], engines_here: int) -> int | None:
    """Torch threads for each embedded engine (``engine.num_threads``): the configured number; none
    (torch's own choice) when ``OMP_NUM_THREADS`` is set in the engine's environment; else the CPUs this
    process may use, less one, shared among the ``engines_here`` engines (at least 1)."""
    if configured:
        return int(configured)
    if env.get("OMP_NUM_THREADS"):
        return None
    return max(1, (available_cpus() - 1) // max(1, engines_here))


def available_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


@dataclass
class ServedEngine:
    id: str
    url: str
    backend: str
    pid: int | None


class EngineProcesses:
    """``with EngineProcesses(run, cfg) as g: g.urls`` — engines up, healthy and registered."""

    def __init__(self, run: RunDir, cfg: SlimectlConfig, engine_urls: list[str] | tuple[str, ...] = (),
                 model_path: str | None = None, python: str | None = None, engine_indices: list[int] | None = None,
                 weight_version: WeightChoice = None, verify=None, group: str | None = None):
        """``engine_indices``: which of the ``engine.num_engines`` engines this group launches (all by
        default; a launcher that places each engine in its own process passes one index each).
        ``weight_version``: the weights launched engines start from (None: the newest published
        ``weights/N``, else ``model.path`` at version 0; N: ``weights/N``; ``"initial"``:
        ``model.path``). An explicit ``model_path`` is served at version 0 unless a version is given.
        ``verify(url, version)``: the problems found reading back the weights of an engine started again by the
        heartbeat (:mod:`slimectl.engines.health`; one line each, empty: they match ``weights/version``).
        ``group``: the name of a frozen engine group (``engine.groups``; ``cfg`` its :meth:`~slimectl.contract.
        config_schema.SlimectlConfig.group_config`): its model at version 0, always, registered in
        ``RUN/engines/groups/NAME/`` (:class:`FrozenGroups`)."""
        from slimectl.engines.supervisor import ProcessSupervisor

        self.run = run
        self.cfg = cfg
        self.group = group
        self.registry = run.engine_group(group) if group else run.engines
        self.prefix = f"{group}-" if group else ""  # its engines' log files and record ids
        self.engine_urls = list(engine_urls) or list(cfg.engine.urls)
        self.backend = "external" if self.engine_urls else cfg.engine.backend
        self.explicit_model_path = model_path
        self.model_path = model_path or cfg.model.path
        self.weight_choice = weight_version
        self.weight_version = INITIAL_WEIGHT_VERSION
        self.python = python or sys.executable
        self.engine_indices = list(range(cfg.engine.num_engines)) if engine_indices is None else list(engine_indices)
        self.engine_threads: dict[int, int | None] = {}
        """Torch threads of each embedded engine launched here, by port (None: torch's own choice)."""
        self.supervisor = ProcessSupervisor()
        self.engines: list[ServedEngine] = []
        self.router: ServedEngine | None = None
        self.token = cfg.engine.token()
        self.weight_format = weight_format(cfg)  # full weights, or a LoRA run's adapter (merged or not)
        self.after_start = None  # a version launched engines load once healthy (a LoRA run's adapter)
        self.staging: Path | None = None  # a model they start from, written for them (engine.lora_merged)
        self.verify = verify
        self.restart_check = "checked"
        """How the last engine started again was checked (said in the heal's log line)."""
        self.lock = threading.RLock()  # a weight sync, or the heartbeat healing an engine
        self.watcher = None  # the heartbeat (engine.health_check), once the engines are up
        self.lost: dict[str, str] = {}  # url -> the line saying why that engine is gone for good

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    # ------------------------------------------------------------------ start
    def start(self) -> "EngineProcesses":
        ec = self.cfg.engine
        router_python = self._check_router()  # before anything else: a refusal is the only line printed
        if self.backend == "external" and not self.engine_urls:
            raise UsageError("engine.backend is external but no engine URLs were given; pass --engine-url URL")
        if self.backend == "external" and self.weight_choice is not None:
            raise UsageError("--weight-version/--initial apply to engines serve launches; external engines "
                             "(--engine-url) report their own version: sync them with `slimectl sync`")
        if self.backend != "external":
            self.weight_format.publish_initial(self.run)  # a LoRA run's weights/0
            path, self.weight_version = self._resolve_weights()
            start = self.weight_format.engine_start(self.run, path, self.weight_version,
                                                    base=self.explicit_model_path or self.cfg.model.path)
            self.model_path, self.after_start, self.staging = start.model_path, start.after, start.staging
            if not self.model_path or not Path(self.model_path).is_dir():
                raise UsageError(f"model.path = {self.model_path}: no such model directory for the engines")
            if not self.token and ec.host not in ("127.0.0.1", "localhost", "::1"):
                log.warning("engines listen on %s without a token: anyone who can reach them can replace or read their "
                            "weights; set %s (engine.token_env) to require one", ec.host or "all interfaces",
                            ec.token_env)
            self._check_ports()
        try:
            if self.backend == "external":
                self._attach_external()
            else:
                launched = []
                reach = advertised_host(ec.host, ec.advertise_host)
                # Without engine.port, an embedded engine binds port 0 and reports the system's pick in a port
                # file: no window in which another serve (or any socket) takes a port chosen for it. SGLang
                # servers get a port probed free just before they start.
                own_ports = self.backend == "embedded" and not ec.port
                ports_dir = Path(tempfile.mkdtemp(prefix="slimectl-ports-")) if own_ports else None
                try:
                    for i in self.engine_indices:
                        port = 0 if own_ports else ec.port + i if ec.port else free_port(ec.host)
                        argv, env, secrets = self._launch_argv(i, port)
                        if ports_dir:
                            argv += ["--port-file", str(ports_dir / f"engine-{i}")]
                        nonce = env.get(ENGINE_NONCE_ENV) if self.backend == "embedded" else None
                        proc = self.supervisor.start(f"engine-{i}", argv, env=env, secrets=secrets, nonce=nonce,
                                                     url=None if ports_dir else _url(reach, port),
                                                     log_path=self._log_path(f"engine-{i}"))
                        launched.append((i, proc))
                    if ports_dir:
                        for i, proc in launched:
                            proc.url = _url(reach, self.supervisor.wait_port_file(
                                proc, ports_dir / f"engine-{i}", timeout=ec.startup_timeout_s))
                finally:
                    if ports_dir:
                        shutil.rmtree(ports_dir, ignore_errors=True)
                launched = [(i, proc.url, proc.pid) for i, proc in launched]
                self.supervisor.wait_all_healthy([u for _, u, _ in launched], timeout=ec.startup_timeout_s,
                                                 interval=0.25)
                if self.after_start is not None:
                    self._load_after_start([u for _, u, _ in launched])
                if self.staging is not None:
                    shutil.rmtree(self.staging, ignore_errors=True)
                for i, url, pid in launched:
                    self._register(f"engine-{i}", url, pid, self.weight_version)
                if router_python:
                    self._start_router(router_python)
                if ec.health_check.enabled:
                    from slimectl.engines.health import EngineWatcher

                    self.watcher = EngineWatcher(self, ec.health_check).start()
        except BaseException:
            self.stop()
            raise
        return self

    def _wants_router(self) -> bool:
        """engine.router, for a group that launches every engine (a launcher that starts one engine
        per group, e.g. Ray, gets no router)."""
        return bool(self.cfg.engine.router) and len(self.engine_indices) == self.cfg.engine.num_engines

    def _check_router(self) -> str | None:
        """The interpreter to start sglang-router with, when one is wanted (checked before any engine starts)."""
        ec = self.cfg.engine
        if not ec.router:
            return None
        if self.backend == "external":
            raise UsageError("engine.router starts sglang-router in front of the engines serve launches, not external "
                             "ones (--engine-url): drop --engine-url, or set engine.router: false")
        if not self._wants_router():
            log.warning("engine.router: this launcher starts each engine on its own; no router is started, rollout "
                        "balances over the engines itself")
            return None
        from slimectl.engines.sglang.launcher import router_import_problem

        python = ec.router_python or ec.sglang_python or self.python
        why = router_import_problem(python)
        if why:
            key = "engine.router_python" if ec.router_python else (
                "engine.sglang_python (engine.router_python unset)" if ec.sglang_python else
                "engine.router_python (unset: serve's own interpreter)")
            raise UsageError(f"engine.router is true but {key} = {python} cannot run sglang-router: {why}; install it "
                             f"there (pip install sglang-router==0.3.2) or set engine.router_python to an interpreter "
                             f"that has it")
        return python

    def _start_router(self, python: str) -> None:
        from slimectl.engines.sglang.launcher import launch_router

        ec = self.cfg.engine
        urls = self.urls
        port = ec.port + ec.num_engines if ec.port else free_port(ec.host)
        router = launch_router(self.supervisor, urls, port, host=ec.host, python=python,
                               log_path=self.run.path / "logs" / "router.log", health_timeout=ec.startup_timeout_s,
                               interval=0.25, wait_workers=True)
        url = _url(advertised_host(ec.host, ec.advertise_host), port)
        rec = self.run.routers.register(EngineRecord(
            url=url, backend="sglang-router", pid=router.pid, id=f"router-{os.getpid()}",
            extra={"workers": urls, "log": str(router.log_path)}))
        self.router = ServedEngine(rec.id, url, "sglang-router", router.pid)
        log.info("router %s ready at %s in front of %s", rec.id, url, ", ".join(urls))

    def _load_after_start(self, urls: list[str]) -> None:
        """Every launched engine loads :attr:`after_start` from disk (a LoRA run: the version's adapter)."""
        import asyncio

        from slimectl.engines.client import EngineClient, EngineError

        source = self.after_start

        async def load_all() -> None:
            clients = {u: EngineClient(u, token=self.token, timeout=self.cfg.engine.startup_timeout_s) for u in urls}
            try:
                await source.form.push_disk(clients, source)
            finally:
                await asyncio.gather(*(c.close() for c in clients.values()), return_exceptions=True)

        try:
            asyncio.run(load_all())
        except EngineError as exc:
            raise SlimectlError(f"the engines could not load the {source.form.name} weights {source.hf_dir}: "
                                f"{exc}") from None
        log.info("engines serve %s with the %s weights %s", self.model_path, source.form.name, source.hf_dir)

    def _resolve_weights(self, choice: WeightChoice = None) -> tuple[str | None, str]:
        """(the model directory launched engines load, its weight version): for ``choice``, else the group's."""
        choice = self.weight_choice if choice is None else choice
        initial = self.explicit_model_path or self.cfg.model.path
        if choice == "initial" or (choice is None and self.explicit_model_path) or self.group:  # a frozen group: its
            # model, always (the run's weights/N are the actor's)
            log.info("serving the initial weights %s at weight version %s", initial, INITIAL_WEIGHT_VERSION)
            return initial, INITIAL_WEIGHT_VERSION
        ids = self.run.weights.ids()
        if choice is None:
            if not ids:
                log.info("no published weights in %s: serving %s at weight version %s", self.run.weights.root,
                         initial, INITIAL_WEIGHT_VERSION)
                return initial, INITIAL_WEIGHT_VERSION
            choice = ids[-1]
        if self.run.weights.exists(choice):
            art = self.run.weights.get(choice)  # checks every file is there, at its published size
            log.info("serving weights/%06d (weight version %d)", choice, choice)
            return str(art.path), str(choice)
        if choice == 0:
            log.info("serving the initial weights %s at weight version %s", initial, INITIAL_WEIGHT_VERSION)
            return initial, INITIAL_WEIGHT_VERSION
        if not ids:
            raise UsageError(f"--weight-version {choice}: weights/{choice:06d} is not published in {self.run.path} "
                             f"(no weights are published yet); omit --weight-version to serve model.path")
        raise UsageError(f"--weight-version {choice}: weights/{choice:06d} is not published in {self.run.path} "
                         f"(published versions: {', '.join(map(str, ids))}); pick one of those, or omit "
                         f"--weight-version for the newest")

    def _log_path(self, name: str) -> Path:
        """``RUN/logs/[GROUP-]NAME.log``: an engine's log (a frozen group's name first)."""
        return self.run.path / "logs" / f"{self.prefix}{name}.log"

    def _check_ports(self) -> None:
        """A fixed ``engine.port`` that something already listens on is refused before any engine
        starts (else the health probe would talk to whatever holds it)."""
        ec = self.cfg.engine
        if not ec.port:
            return
        router = [ec.num_engines] if self._wants_router() and self.backend != "external" else []
        for i in self.engine_indices + router:
            port = ec.port + i
            if port_in_use(ec.host, port):
                first = f" ({'the router' if i == ec.num_engines else f'engine {i}'} of --port {ec.port})" if i else ""
                raise UsageError(f"port {port}{first} on {ec.host or '0.0.0.0'} is already in use (another engine "
                                 f"or program listens there); pick a free port with --port, or omit --port "
                                 f"(--port 0) to let serve choose free ports")

    def _launch_argv(self, i: int, port: int) -> tuple[list[str], dict[str, str], list[str]]:
        ec = self.cfg.engine
        env = dict(os.environ)
        if self.backend == "embedded":
            env.update(ec.env)  # engine.env (SGLang's go through its launch spec below)
            # the engine reports this nonce in /server_info: the health check accepts it as ours
            env[ENGINE_NONCE_ENV] = token_hex(16)
            from slimectl.engines.embedded import server_argv

            argv = [*server_argv(self.python), "--model-path", str(self.model_path),
                    "--host", ec.host, "--port", str(port), "--dtype", self.cfg.model.dtype,
                    "--weight-version", self.weight_version, "--max-running-requests", str(ec.max_batch_size),
                    "--parent-pid", str(os.getpid())]
            threads = embedded_threads(ec.num_threads, env, len(self.engine_indices))
            self.engine_threads[port] = threads
            if threads:
                argv += ["--num-threads", str(threads)]
            if self.token:
                argv += ["--admin-api-key-env", ec.token_env]  # the child reads the token from its environment
            return argv, env, [self.token] if self.token else []
        from slimectl.engines.sglang.launch_spec import SGLangLaunchSpec, build_env, build_sglang_argv

        from slimectl.backends.hf.dtypes import HF_NAMES

        dtype = HF_NAMES[self.cfg.model.dtype]
        per = ec.tp_size
        gpus = ec.gpu_ids[i * per:(i + 1) * per] if ec.gpu_ids else []
        extra = dict(ec.sglang_args)
        if (self.cfg.rollout.return_routed_experts or self.cfg.train.use_rollout_routing_replay) and not any(
                k.strip("-").replace("-", "_") == "enable_return_routed_experts" for k in extra):
            # SGLang answers return_routed_experts only when started with this flag (routing replay, R3)
            extra["enable_return_routed_experts"] = True
        for k, v in self.weight_format.engine_args(extra).items():  # what engines need to take the run's format
            extra.setdefault(k, v)
        spec = SGLangLaunchSpec(model_path=str(self.model_path), port=port, host=ec.host, tp_size=ec.tp_size,
                                mem_fraction_static=ec.mem_fraction_static, dtype=dtype, gpu_ids=gpus,
                                weight_version=self.weight_version, admin_api_key=self.token,
                                extra_args=extra, python=ec.sglang_python or self.python,
                                env=dict(ec.env))
        return build_sglang_argv(spec), build_env(spec, env), spec.secrets()

    def _attach_external(self) -> None:
        import asyncio

        from slimectl.engines.client import EngineClient

        async def check(url: str) -> str:
            async with EngineClient(url, token=self.token, retries=2) as c:
                await c.wait_healthy(timeout=self.cfg.engine.startup_timeout_s)
                return await c.weight_version()

        for i, url in enumerate(self.engine_urls):
            version = asyncio.run(check(url))
            self._register(f"external-{i}", url.rstrip("/"), None, version)

    def _register(self, name: str, url: str, pid: int | None, version: str = INITIAL_WEIGHT_VERSION) -> None:
        # "log": for "its process died"; "owner": this process, which heals the engine (the record is not pruned as
        # dead while its owner lives: registry.prune_dead); "heals": whether it does (a pool waits for a healed
        # engine, engines/pool.py)
        extra = {"log": str(self._log_path(name)),
                 "owner": this_process(),
                 "heals": self.cfg.engine.health_check.enabled} if pid is not None else {}
        if self.group:
            extra["group"] = self.group
        rec = self.registry.register(EngineRecord(url=url, backend=self.backend, pid=pid, weight_version=version,
                                                  id=f"{self.prefix}{name}-{os.getpid()}", extra=extra))
        self.engines.append(ServedEngine(rec.id, url, self.backend, pid))
        log.info("engine %s ready at %s (%s)", rec.id, url, self.backend)

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        if self.router is not None:
            self.run.routers.unregister(self.router.id)
            self.router = None
        for e in self.engines:
            self.registry.unregister(e.id)
        self.engines = []
        self.supervisor.stop()

    def check_alive(self) -> None:
        """Raise naming the first engine process that has exited (and its log). With the heartbeat on, a dead
        engine is its to restart: raise only for an engine lost for good under ``engine.on_lost: stop``, or
        when every engine is lost."""
        if self.watcher is None:
            for p in self.supervisor.processes:
                if p.popen.poll() is not None:
                    raise SlimectlError(f"{p.name} at {p.url} exited with code {p.popen.returncode}; see {p.log_path}")
            return
        from slimectl.engines.health import lost_for_good

        line = lost_for_good(self.lost, len(self.engine_indices), self.cfg.engine.on_lost)
        if line:
            raise SlimectlError(line)

    # ------------------------------------------------------------------ heal (the heartbeat's)
    def watched(self) -> list:
        """The engines the heartbeat watches (:class:`~slimectl.engines.health.Watched`): every one launched
        here, less those lost for good."""
        from slimectl.engines.health import Watched

        return [Watched(p.name, p.url, p.returncode) for p in self.supervisor.processes
                if p.name.startswith("engine-") and p.url not in self.lost]

    def heal(self, loss) -> None:
        """Kill the lost engine's process group, start it again on its port at the weight version it was on
        (``weights/N`` loaded whole), check its weights, register it again; an engine that does not come back
        is recorded in :attr:`lost` (one line). Its record stays until then: a request that fails on it
        meanwhile is told its process died."""
        import time

        served = next((e for e in self.engines if e.url == loss.url), None)
        version = self._restart_version(served)
        log.warning("%s at %s is lost: %s; killing it and starting it again at weight version %s", loss.name,
                    loss.url, loss.why, version)
        self.supervisor.stop(timeout=0.0, names=[loss.name])  # SIGKILL to its process group (a stopped one too)
        fault_point("serve.engine_killed")
        try:
            pid, version = self.restart(loss.name, loss.url, version)
        except (SlimectlError, OSError) as exc:
            if served is not None:
                self.registry.unregister(served.id)
                self.engines.remove(served)
            from slimectl.engines.health import give_up

            give_up(self.lost, loss, exc, len(self.engine_indices), self.cfg.engine.on_lost)
            return
        if served is not None:
            self.engines.remove(served)
        self._register(loss.name, loss.url, pid, version)  # the same id: its record, rewritten
        log.warning("%s at %s is back at weight version %s (%s), %.1fs after it was found lost", loss.name,
                    loss.url, version, self.restart_check, time.monotonic() - loss.at)

    def _recorded_version(self, served: ServedEngine | None) -> str:
        """The weight version the registry last recorded for ``served`` (the group's when it has no record)."""
        try:
            return str(self.registry.get(served.id).weight_version) if served else self.weight_version
        except (SlimectlError, OSError, KeyError):
            return self.weight_version

    def _restart_version(self, served: ServedEngine | None) -> str:
        """The version ``served`` starts again at: the one recorded; when its ``weights/N`` is not on disk (pruned
        meanwhile, ``sync.keep_weights``; or never written: ``sync.transport: distributed`` between two checkpoints),
        the newest published one, else the initial weights (version 0). The next sync brings it to the current
        version (``rl`` builds its weight-update group again for it)."""
        return self._on_disk_or_newest(self._recorded_version(served), served.id if served else "the engine")

    def _on_disk_or_newest(self, version: str, who: str) -> str:
        """``version`` when its ``weights/N`` is on disk (or it is the initial one); else the newest published
        version, else the initial one, said in a warning naming ``who``."""
        if not (version.isdigit() and int(version) > 0) or self.run.weights.exists(int(version)):
            return version
        ids = self.run.weights.ids()
        newest = str(ids[-1]) if ids else INITIAL_WEIGHT_VERSION
        log.warning("weights/%06d is not on disk; starting %s at %s instead (the next sync brings it to the current "
                    "version)", int(version), who,
                    f"weights/{int(newest):06d}" if ids else "the initial weights (version 0)")
        return newest

    def _restart(self, name: str, url: str, version: str) -> tuple[int, str]:
        """Start engine ``name`` again at ``url`` on ``weights/version``; its pid and weight version once healthy
        and checked (a newer one when a process attached to the run synced it meanwhile)."""
        from urllib.parse import urlsplit

        from slimectl.contract.faults import ENV as FAULT_ENV

        path, version = self._resolve_weights(int(version) if version.isdigit() else "initial")
        start = self.weight_format.engine_start(self.run, path, version,
                                                base=self.explicit_model_path or self.cfg.model.path)
        self.model_path, self.after_start, self.staging = start.model_path, start.after, start.staging
        self.weight_version = version  # what _launch_argv starts it at
        if not self.model_path or not Path(self.model_path).is_dir():
            raise UsageError(f"its weights {self.model_path} are not there (no such model directory)")
        argv, env, secrets = self._launch_argv(int(name.rsplit("-", 1)[1]), urlsplit(url).port)
        env.pop(FAULT_ENV, None)  # a fault injected into the engines is injected once
        nonce = env.get(ENGINE_NONCE_ENV) if self.backend == "embedded" else None
        proc = self.supervisor.start(name, argv, env=env, secrets=secrets, nonce=nonce, url=url,
                                     log_path=self._log_path(name))
        try:
            self.supervisor.wait_healthy(url, timeout=self.cfg.engine.startup_timeout_s, interval=0.25)
            if self.after_start is not None:
                self._load_after_start([url])
            version = self._check_restarted(url, version)
        except BaseException:
            self.supervisor.stop(timeout=0.0, names=[name])
            raise
        finally:
            if self.staging is not None:
                shutil.rmtree(self.staging, ignore_errors=True)
        fault_point("serve.engine_restarted")
        return proc.pid, version

    def restart(self, name: str, url: str, version: str) -> tuple[int, str]:
        """Start engine ``name`` (``engine-N``) of this group again at ``url`` on ``weights/version`` (a frozen group:
        its model at version 0), wait until it is healthy and checked (``verify``); its pid and the weight version it
        reports (a newer one when a process attached to the run synced it meanwhile). It is not registered: the
        caller does that (:meth:`heal`, or the Ray launcher's engine actor, :mod:`slimectl.orchestration.ray_engines`).
        What is left of an earlier process under that name is the caller's to kill first. When it fails because
        ``weights/version`` left the disk meanwhile (an attached ``rl`` pruned it, ``sync.keep_weights``, while the
        engine loaded it or its weights were checked against it), it is made again at the newest published version,
        three tries in all; any other failure is raised as it is."""
        for _ in range(2):
            try:
                return self._restart(name, url, version)
            except (SlimectlError, OSError) as exc:
                now = self._on_disk_or_newest(version, name)
                if now == version:
                    raise
                log.warning("starting %s again at weight version %s failed (%s): weights/%06d left the disk "
                            "meanwhile; starting it at weight version %s", name, version, exc, int(version), now)
                version = now
        return self._restart(name, url, version)

    def _check_restarted(self, url: str, version: str) -> str:
        """The engine started again reports ``version`` and its weights read back match (``self.verify``); its
        version. An ``rl`` or ``sync`` attached to the run (another process, which this group's lock does not
        hold off) may sync it once it answers: a newer published version it then reports is checked instead, and a
        check that a sync overtook is made again (twice at most)."""
        import asyncio

        from slimectl.engines.client import EngineClient

        async def reported() -> str:
            async with EngineClient(url, token=self.token, retries=1) as c:
                return await c.weight_version()

        for _ in range(3):
            got = asyncio.run(reported())
            if got != version and not (got.isdigit() and version.isdigit() and int(got) > int(version)
                                       and self.run.weights.exists(int(got))):
                raise SlimectlError(f"it came back reporting weight version {got}, not {version}")
            problems = self.verify(url, got) if self.verify is not None else []
            if not problems:
                self.restart_check = _how_checked(self.verify is not None, getattr(problems, "verified", True))
                return got
            if asyncio.run(reported()) == got:
                break
        raise SlimectlError(f"its weights do not match weights/{got}: {'; '.join(problems)}")

    def __enter__(self) -> "EngineProcesses":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FrozenGroups:
    """``with FrozenGroups(run, cfg) as f: f.urls`` — every frozen group of ``engine.groups`` (a teacher, a judge, a
    reference) up, healthy and registered in ``RUN/engines/groups/NAME/``, each an :class:`EngineProcesses` of its
    own (its model at weight version 0, its heartbeat); ``serve`` and ``rl`` hold it beside the actor's group.
    No sync reaches these engines and no rollout generates on them: they are not in ``RUN/engines/``."""

    def __init__(self, run: RunDir, cfg: SlimectlConfig):
        self.groups = {g.name: EngineProcesses(run, cfg.group_config(g.name), group=g.name)
                       for g in cfg.engine.frozen_groups}

    @property
    def urls(self) -> dict[str, list[str]]:
        """Each group's engine URLs, by group name."""
        return {name: group.urls for name, group in self.groups.items()}

    def start(self) -> "FrozenGroups":
        try:
            for name, group in self.groups.items():
                group.start()
                log.info("engine group %s (frozen, %s) ready: %s", name, group.model_path, ", ".join(group.urls))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for group in self.groups.values():
            group.stop()

    def check_alive(self) -> None:
        """:meth:`EngineProcesses.check_alive` of every group (a group's line names it)."""
        for name, group in self.groups.items():
            try:
                group.check_alive()
            except SlimectlError as exc:
                raise SlimectlError(f"engine group {name}: {exc}") from None

    def __enter__(self) -> "FrozenGroups":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(run: RunDir, cfg: SlimectlConfig, engine_urls: list[str] | tuple[str, ...] = (),
          ready: threading.Event | None = None, stop: threading.Event | None = None, announce=print,
          weight_version: WeightChoice = None, verify=None) -> None:
    """Start the engines, print their URLs, and keep them up until SIGINT/SIGTERM (or ``stop``).
    ``weight_version``, ``verify``: see :class:`EngineProcesses` (default: the newest published weights; an
    engine the heartbeat starts again is checked by the version it reports alone)."""
    with run.stage_log("serve"):
        stop = stop or threading.Event()
        with run.lock("serve"):
            dead = run.engines.prune_dead()  # records of this host's earlier serve, killed before it unregistered
            if dead:
                log.info("removed the records of dead engines %s", ", ".join(dead))
            group = EngineProcesses(run, cfg, engine_urls, weight_version=weight_version, verify=verify)
            frozen = FrozenGroups(run, cfg)
            with set_on_signals(stop), group, frozen:  # SIGINT/SIGTERM stop the engines; the old handlers come back
                for url in group.urls:
                    announce(url)
                if ready is not None:
                    ready.set()
                while not stop.wait(1.0):
                    group.check_alive()
                    frozen.check_alive()
            log.info("engines stopped")
