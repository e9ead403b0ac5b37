"""What slimectl does about real SGLang 0.5.23: ``sync --verify`` on a model without
``get_weights_by_name``, the current ``/model_info`` / ``/server_info`` endpoints with a fallback,
``engine.env``, and greedy (temperature 0) rollouts.

The "SGLang" here is a small aiohttp server that answers with the bodies and statuses captured
from the real server (``shared/reference/sglang-protocol``): a Qwen2 that answers
``/get_weights_by_name`` with 400, or an older server without the current info endpoints.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from slimectl.contract.config import load_config
from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import ConfigError
from slimectl.engines.client import EngineClient, EngineError
from tests.helpers import ROOT, slimectl_in_process

FIXTURES = ROOT.parent / "shared" / "reference" / "sglang-protocol"
if not FIXTURES.is_dir():  # CI lays shared/ beside the clone
    FIXTURES = Path(os.environ.get("SLIMECTL_SHARED", "/work/shared")) / "reference" / "sglang-protocol"


def fixture(name: str) -> tuple[int, object]:
    """(HTTP status, body) of a captured SGLang response."""
    status = {e["file"]: e["status"] for e in json.loads((FIXTURES / "_index.json").read_text())}[name]
    return status, json.loads((FIXTURES / f"{name}.response.json").read_text())


class FakeSGLang:
    """An aiohttp server on its own thread answering like SGLang 0.5.23 serving a tiny Qwen2.

    ``legacy``: an older server, only ``/get_model_info`` and ``/get_server_info`` (404 for the
    current names). ``info_status``: answer the current info endpoints with this error status.
    ``readable``: names ``/get_weights_by_name`` answers (from ``tensors``); every other name gets
    the captured 400. ``hits``: every request's ``METHOD path``."""

    def __init__(self, legacy: bool = False, info_status: int | None = None,
                 tensors: dict[str, torch.Tensor] | None = None, readable: tuple[str, ...] = ()):
        self.legacy, self.info_status = legacy, info_status
        self.tensors, self.readable = tensors or {}, readable
        self.hits: list[str] = []
        self.version = "default"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{port}"

    async def _start(self):
        from aiohttp import web

        from slimectl.web.server import start_site

        @web.middleware
        async def record(request, handler):
            self.hits.append(f"{request.method} {request.path}")
            return await handler(request)

        app = web.Application(middlewares=[record])
        r = app.router
        info = {"model": "model_info__v0", "server": "server_info__ok"}
        for kind, name in info.items():
            if not self.legacy:
                r.add_get(f"/{kind}_info", self._info(name, self.info_status))
            r.add_get(f"/get_{kind}_info", self._info(name))
        r.add_post("/pause_generation", self._canned("pause_generation__mode_abort"))
        r.add_route("*", "/flush_cache", self._canned("flush_cache__idle", text=True))
        r.add_post("/continue_generation", self._canned("continue_generation__after_abort"))
        r.add_post("/update_weights_from_disk", self._update)
        r.add_post("/get_weights_by_name", self._weights)
        return await start_site(app, "127.0.0.1", 0)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def _info(self, name: str, status: int | None = None):
        from aiohttp import web

        async def handler(request):
            if status is not None:
                return web.json_response({"error": {"message": "scheduler busy"}}, status=status)
            _, body = fixture(name)
            return web.json_response({**body, "weight_version": self.version})
        return handler

    def _canned(self, name: str, text: bool = False):
        from aiohttp import web

        async def handler(request):
            status, body = fixture(name)
            return web.Response(text=body, status=status) if text else web.json_response(body, status=status)
        return handler

    async def _update(self, request):
        from aiohttp import web

        body = await request.json()
        self.version = body.get("weight_version", self.version)
        status, ok = fixture("update_weights_from_disk__mod_v1")
        return web.json_response({**ok, "message": f"Succeeded to update model weights. Weight version updated "
                                                   f"to {self.version}."}, status=status)

    async def _weights(self, request):
        from aiohttp import web

        body = await request.json()
        if body["name"] in self.readable:
            return web.json_response(self.tensors[body["name"]][: body["truncate_size"]].tolist())
        status, refusal = fixture("get_weights_by_name__norm")
        return web.json_response(refusal, status=status)


@pytest.fixture
def fake_sglang():
    servers: list[FakeSGLang] = []

    def make(**kw) -> FakeSGLang:
        servers.append(FakeSGLang(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def info_calls(client: EngineClient) -> tuple[dict, dict, dict]:
    async def go():
        try:
            return await client.get_model_info(), await client.get_server_info(), await client.get_model_info()
        finally:
            await client.close()
    return asyncio.run(go())


# ----------------------------------------------------------------------------- endpoints


def test_client_calls_current_info_endpoints(fake_sglang):
    srv = fake_sglang()
    model, server, again = info_calls(EngineClient(srv.url))
    assert model["architectures"] == ["Qwen2ForCausalLM"] and server["version"] == "0.5.23"
    assert srv.hits == ["GET /model_info", "GET /server_info", "GET /model_info"]


def test_client_falls_back_on_404_once_per_client(fake_sglang):
    srv = fake_sglang(legacy=True)
    model, server, again = info_calls(EngineClient(srv.url))
    assert model["weight_version"] == again["weight_version"] == "default" and server["dtype"] == "auto"
    # the 404 is paid once per endpoint; the deprecated path is remembered for this client
    assert srv.hits == ["GET /model_info", "GET /get_model_info", "GET /server_info", "GET /get_server_info",
                        "GET /get_model_info"]


def test_client_does_not_fall_back_on_other_errors(fake_sglang):
    srv = fake_sglang(info_status=503)
    with pytest.raises(EngineError) as exc:
        info_calls(EngineClient(srv.url))
    assert exc.value.status == 503 and "GET /model_info failed with HTTP 503: scheduler busy" in str(exc.value)
    assert srv.hits == ["GET /model_info"]


# ----------------------------------------------------------------------------- sync --verify


def tiny_weights(d: Path) -> dict[str, torch.Tensor]:
    """A model directory init accepts (config.json) with a safetensors file of 10 tensors."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] + \
        [f"model.layers.{i}.mlp.up_proj.weight" for i in range(7)]
    tensors = {n: torch.randn(6, 4, generator=g) for n in names}
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    return tensors


@pytest.fixture
def run(tmp_path):
    from slimectl.contract.rundir import RunDir

    tensors = tiny_weights(tmp_path / "model")
    res = slimectl_in_process("init", tmp_path / "run", "--set", f"model.path={tmp_path / 'model'}",
                              "--set", "logging.tensorboard=false")
    assert res.returncode == 0, res.stderr
    return RunDir.open(tmp_path / "run"), tensors


def test_sync_verify_on_a_model_without_read_back_warns_once_and_succeeds(run, fake_sglang):
    run, _ = run
    a, b = fake_sglang(), fake_sglang()
    res = slimectl_in_process("sync", "-r", run.path, "--version", "0", "--verify",
                              "--engine-url", a.url, "--engine-url", b.url)
    assert res.returncode == 0, res.stderr
    # the weights were loaded (both report version 0), and no "verified" is claimed
    assert res.stdout.startswith(f"weight version 0 -> {a.url}, {b.url} (disk, ") and "verified" not in res.stdout
    warnings = [ln for ln in res.stderr.splitlines() if "sync --verify" in ln]
    assert len(warnings) == 1, res.stderr
    w = warnings[0]
    assert w.startswith(
        f"sync --verify: verification was not possible on {a.url}, {b.url} (SGLang 0.5.23 serving Qwen2ForCausalLM): "
        f"they cannot read weights back (POST /get_weights_by_name failed with HTTP 400: Get parameter by name "
        f"failed), so all 8 sampled tensors were skipped — the weights were loaded and the new version reported; "
        f"only their values are unchecked")
    assert a.version == b.version == "0"
    assert a.hits.count("POST /get_weights_by_name") == 8 and "GET /get_model_info" not in a.hits


def test_verify_compares_what_it_can_and_still_catches_a_mismatch(run, fake_sglang, caplog):
    from slimectl.stages.sync import WeightSource
    from slimectl.stages.sync.verify import verify_engines

    run, tensors = run
    readable = ("model.norm.weight", "lm_head.weight")
    good = fake_sglang(tensors=tensors, readable=readable)
    wrong = {n: t + 1 for n, t in tensors.items()}
    bad = fake_sglang(tensors=wrong, readable=("lm_head.weight",))
    source = WeightSource.from_dir(0, run.config().model.path)

    async def check(*servers):
        clients = {s.url: EngineClient(s.url) for s in servers}
        try:
            return await verify_engines(clients, source)
        finally:
            for c in clients.values():
                await c.close()

    with caplog.at_level(logging.INFO, logger="slimectl.sync"):
        report = asyncio.run(check(good))
    assert report == [] and report.verified and (report.checked, report.skipped) == (2, 6)
    assert report.warning == (
        f"sync --verify: {good.url} (SGLang 0.5.23 serving Qwen2ForCausalLM) cannot read back 6 of 8 sampled "
        f"tensors (POST /get_weights_by_name failed with HTTP 400: Get parameter by name failed); skipped "
        f"model.embed_tokens.weight, model.layers.1.mlp.up_proj.weight, model.layers.2.mlp.up_proj.weight ... and "
        f"compared the other 2")
    assert [r.message for r in caplog.records] == [report.warning]
    report = asyncio.run(check(bad))  # a tensor read back that differs is still a problem
    assert report == [f"engine {bad.url}: weight lm_head.weight differs from weight version 0 (max abs diff 1)"]
    assert not report.verified


# ----------------------------------------------------------------------------- engine.env


def test_engine_env_reaches_both_launch_paths(run, monkeypatch):
    from slimectl.engines.supervisor import ENGINE_NONCE_ENV
    from slimectl.stages.serve import EngineProcesses

    run, _ = run
    cfg = run.config()
    cfg.engine.env = {"SGLANG_USE_CPU_ENGINE": "1", ENGINE_NONCE_ENV: "mine"}
    monkeypatch.setenv("SG19_INHERITED", "yes")
    argv, env, _ = EngineProcesses(run, cfg)._launch_argv(0, 30000)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["SG19_INHERITED"] == "yes"
    assert env[ENGINE_NONCE_ENV] != "mine"  # the launcher's own nonce wins
    cfg.engine.backend = "sglang"
    cfg.engine.sglang_args = {"device": "cpu"}
    argv, env, _ = EngineProcesses(run, cfg)._launch_argv(0, 30000)
    assert argv[1:3] == ["-m", "sglang.launch_server"] and argv[-2:] == ["--device", "cpu"]
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["SG19_INHERITED"] == "yes"


def test_embedded_engines_leave_a_core_free_unless_told_otherwise(run, monkeypatch):
    """engine.num_threads: the configured count; none when OMP_NUM_THREADS is set (torch's own); else the
    CPUs less one, shared among the engines started here, at least 1."""
    from slimectl.stages.serve import EngineProcesses, embedded_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(9)))
    assert embedded_threads(None, {}, 1) == 8 and embedded_threads(None, {}, 3) == 2 and embedded_threads(None, {}, 16) == 1
    assert embedded_threads(5, {"OMP_NUM_THREADS": "1"}, 2) == 5
    assert embedded_threads(None, {"OMP_NUM_THREADS": "3"}, 1) is None
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert embedded_threads(None, {}, 1) == 1
    run, _ = run
    cfg = run.config()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))
    argv, _, _ = EngineProcesses(run, cfg)._launch_argv(0, 30000)
    assert argv[argv.index("--num-threads") + 1] == str(3 // cfg.engine.num_engines or 1)
    cfg.engine.env = {"OMP_NUM_THREADS": "2"}
    assert "--num-threads" not in EngineProcesses(run, cfg)._launch_argv(0, 30000)[0]
    cfg.engine.num_threads = 2
    argv, _, _ = EngineProcesses(run, cfg)._launch_argv(0, 30000)
    assert argv[argv.index("--num-threads") + 1] == "2"


def test_routing_replay_starts_sglang_with_return_routed_experts(run):
    """SGLang answers ``return_routed_experts`` only when launched with --enable-return-routed-experts:
    serve adds it when rollout or train wants the routes (once, also when given in sglang_args)."""
    from slimectl.stages.serve import EngineProcesses

    run, _ = run
    cfg = run.config()
    cfg.engine.backend = "sglang"
    assert "--enable-return-routed-experts" not in EngineProcesses(run, cfg)._launch_argv(0, 30000)[0]
    cfg.train.use_rollout_routing_replay = True
    assert EngineProcesses(run, cfg)._launch_argv(0, 30000)[0].count("--enable-return-routed-experts") == 1
    cfg.train.use_rollout_routing_replay, cfg.rollout.return_routed_experts = False, True
    cfg.engine.sglang_args = {"enable-return-routed-experts": True}
    assert EngineProcesses(run, cfg)._launch_argv(0, 30000)[0].count("--enable-return-routed-experts") == 1


@pytest.mark.parametrize("value, message", [
    ({"SGLANG_USE_CPU_ENGINE": 1}, None),
    ({"A-B": "x"}, "'A-B' is not an environment variable name"),
    ({"X": True}, 'X: True is not a string; quote the value (e.g. "1")'),
    ({"SLIMECTL_ENGINE_TOKEN": "s3cret"}, "engine.env sets SLIMECTL_ENGINE_TOKEN, the engine token"),
])
def test_engine_env_config(tmp_path, value, message):
    p = tmp_path / "c.yaml"
    p.write_text(json.dumps({"engine": {"env": value}}))
    if message is None:
        assert load_config(p).engine.env == {"SGLANG_USE_CPU_ENGINE": "1"}
        return
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    assert message in str(exc.value) and "\n" not in str(exc.value)


# ----------------------------------------------------------------------------- temperature 0


def test_temperature_zero_is_allowed_and_negative_is_not():
    cfg = SlimectlConfig.model_validate({"rollout": {"temperature": 0, "eval_temperature": 0}})
    assert cfg.rollout.temperature == cfg.rollout.eval_temperature == 0
    with pytest.raises(ValueError):
        SlimectlConfig.model_validate({"rollout": {"temperature": -0.5}})


def test_greedy_log_probs_are_those_of_the_unscaled_distribution():
    """Temperature 0 computes log-probs at temperature 1 (no division by zero), as SGLang reports them:
    in its captured greedy answer the argmax tokens' log-probs are far from 0 (a tiny random Qwen2,
    vocab 389: uniform would be -5.96), not the ~0 of a temperature-sharpened distribution. The
    trainer-vs-engine check at temperature 0 is tests/integration/test_greedy_and_engine_env.py."""
    from slimectl.backends.megatron.logprobs import logprob_temperature

    assert logprob_temperature(0) == logprob_temperature(1e-7) == 1.0 and logprob_temperature(0.7) == 0.7
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError):
            logprob_temperature(bad)
    req = json.loads((FIXTURES / "generate__ids_logprob_gen.request.json").read_text())
    assert req["sampling_params"]["temperature"] == 0
    _, greedy = fixture("generate__ids_logprob_gen")
    assert all(-6 < lp < -5 for lp, _, _ in greedy["meta_info"]["output_token_logprobs"])


def test_a_fully_async_trainer_takes_the_cores_its_engines_leave(run, monkeypatch):
    """Beside embedded engines it started (fully_async), the trainer's torch threads are the CPUs less the
    engines' threads (at least 1); engines on torch's own thread count, or none started here: unchanged."""
    import torch

    from slimectl.orchestration.local_launcher import share_cores_with_engines
    from slimectl.stages.serve import EngineProcesses

    before = torch.get_num_threads()
    try:
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
        assert share_cores_with_engines({30000: 3, 30001: 2}) == 3 and torch.get_num_threads() == 3
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
        assert share_cores_with_engines({30000: 1}) == 1 and torch.get_num_threads() == 1
        assert share_cores_with_engines({30000: 4}) == 1
        torch.set_num_threads(2)
        assert share_cores_with_engines({30000: None}) is None and share_cores_with_engines({}) is None
        assert torch.get_num_threads() == 2
        run, _ = run  # the launch records each embedded engine's threads
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        group = EngineProcesses(run, run.config())
        group._launch_argv(0, 30000)
        assert group.engine_threads == {30000: 1}
    finally:
        torch.set_num_threads(before)
