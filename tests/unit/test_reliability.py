"""Reliability: crash debris, slices, errors that say where, bad bodies."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


# ----------------------------------------------------------------------------- debris in .staging


def _dead_pid() -> tuple[int, float]:
    from slimectl.contract.rundir.atomic import process_create_time

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    ct = process_create_time(p.pid)
    p.wait()
    return p.pid, ct


def _staging_dir(run_dir, name: str, pid: int, create_time: float | None, size: int) -> Path:
    from slimectl.contract.rundir.atomic import host_id, hostname

    d = run_dir.path / ".staging" / name
    (d / "state").mkdir(parents=True)
    (d / ".writer.json").write_text(json.dumps({"host": hostname(), "host_id": host_id(), "pid": pid,
                                                "create_time": create_time, "stage": "train",
                                                "started": "2026-01-01T00:00:00Z"}))
    (d / "state" / "__0_0.distcp").write_bytes(b"x" * size)
    return d


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_a_stage_start_removes_dead_writers_debris_and_status_lists_the_live_ones(run_dir):
    from slimectl.stages.status import collect_status, format_status

    pid, ct = _dead_pid()
    dead = _staging_dir(run_dir, "checkpoints.000004.deadbeef", pid, ct, 3000)
    live = _staging_dir(run_dir, "rollouts.000002.cafe", os.getpid(), None, 10)
    st = collect_status(run_dir, probe=False)
    assert [d["name"] for d in st["staging_in_use"]] == ["rollouts.000002.cafe"]
    assert f"staging    .staging/rollouts.000002.cafe: " in format_status(st)
    assert "not provably dead" in format_status(st) and "checkpoints.000004" not in format_status(st)

    rec, logger = _Records(), logging.getLogger("slimectl.rundir")
    level = logger.level
    logger.addHandler(rec)
    logger.setLevel(logging.INFO)
    try:
        with run_dir.lock("train"):
            assert not dead.exists()  # removed as the stage started
            assert live.exists()  # its writer (this process) is alive
    finally:
        logger.removeHandler(rec)
        logger.setLevel(level)
    said = [line for line in rec.lines if "leftover" in line]
    assert len(said) == 1 and ".staging/checkpoints.000004.deadbeef" in said[0] and "freed" in said[0], rec.lines
    assert re.search(r"\(3\.\d KB freed\)", said[0]), said  # the 3000-byte shard and the writer record
    assert [d["name"] for d in collect_status(run_dir, probe=False)["staging_in_use"]] == ["rollouts.000002.cafe"]


# ----------------------------------------------------------------------------- dataset specs and files

ARITH = Path(__file__).resolve().parents[2] / "examples" / "data" / "arith.jsonl"


def test_a_bad_eval_slice_fails_at_init_naming_its_key(cli, fake_model, tmp_path):
    res = cli("init", tmp_path / "run", "--set", f"model.path={fake_model}",
              "--set", f'data.eval_data={{"arith": "{ARITH}@[0:x]"}}')
    assert res.exit_code == 2, res.output
    assert f"data.eval_data.arith = {ARITH}@[0:x]: the row slice @[0:x] is not [a:b]" in res.output, res.output
    assert res.output.strip().count("\n") == 0 and not (tmp_path / "run" / "run.json").exists()
    res = cli("init", tmp_path / "run2", "--set", f"model.path={fake_model}", "--set", f"data.prompt_data={ARITH}@[1:2:3]")
    assert res.exit_code == 2 and "data.prompt_data = " in res.output and "row slice @[1:2:3]" in res.output, res.output


def test_one_slice_parser_for_data_and_eval(tmp_path):
    from slimectl.contract.dataspec import DataSpecError, parse_data_spec
    from slimectl.stages.rollout.data import DatasetError, load_prompts

    assert parse_data_spec("a.jsonl@[2:-1]") == ("a.jsonl", slice(2, -1), "@[2:-1]")
    assert parse_data_spec("a.jsonl") == ("a.jsonl", slice(None), "")
    with pytest.raises(DataSpecError, match=r"data.eval_data.x = a.jsonl@\[0:x\]: the row slice"):
        parse_data_spec("a.jsonl@[0:x]", "data.eval_data.x")
    with pytest.raises(DataSpecError, match="data.eval_data.x"):
        load_prompts(f"{ARITH}@[a:b]", "prompt", key="data.eval_data.x")
    with pytest.raises(DatasetError, match=r"data.eval_data.x = .*@\[5:2\]: the row slice @\[5:2\] selects no rows"):
        load_prompts(f"{ARITH}@[5:2]", "prompt", key="data.eval_data.x")
    with pytest.raises(DatasetError, match=r"does not exist; check data.eval_data.x"):
        load_prompts(str(tmp_path / "none.jsonl"), key="data.eval_data.x")


def test_a_non_utf8_dataset_line_is_named(tmp_path):
    from slimectl.stages.rollout.data import DatasetError, load_prompts

    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"input": "ok", "label": "1"}\n{"input": "caf\xe9", "label": "2"}\n')
    with pytest.raises(DatasetError) as err:
        load_prompts(str(p))
    assert f"{p} line 2: not UTF-8 text (byte 0xe9 at column 15)" in str(err.value), err.value
    rows, skipped = load_prompts(str(p), skip_bad_rows=True)
    assert [r.prompt for r in rows] == ["ok"] and skipped == 1


# ----------------------------------------------------------------------------- an engine dying mid-rollout

_SILENT_ENGINE = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0))
s.listen(256)
print(s.getsockname()[1], flush=True)
held = []
while True:
    held.append(s.accept()[0])  # takes the requests, never answers: they are in flight when it dies
"""


def test_an_engine_that_dies_mid_rollout_is_named_once_with_its_log(run_dir):
    import asyncio
    import gc
    import signal
    from types import SimpleNamespace

    from slimectl.contract.rundir.registry import EngineRecord
    from slimectl.contract.samples import Sample
    from slimectl.engines.client import EngineError
    from slimectl.engines.pool import EnginePool
    from slimectl.stages.rollout.generate import default_generate, generate_batch

    proc = subprocess.Popen([sys.executable, "-c", _SILENT_ENGINE], stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{int(proc.stdout.readline())}"
        log_path = run_dir.path / "logs" / "engine-0.log"
        run_dir.engines.register(EngineRecord(url=url, backend="embedded", pid=proc.pid, id="engine-0-1",
                                              extra={"log": str(log_path)}))
        rec, logger = _Records(), logging.getLogger("slimectl")
        rec.setLevel(logging.WARNING)
        logger.addHandler(rec)
        unretrieved: list[str] = []

        async def main():
            asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx["message"]))
            pool = EnginePool([url], registry=run_dir.engines)
            args = SimpleNamespace(pool=pool)
            groups = [[Sample(group_index=g, index=2 * g + j, rollout_id=0, tokens=[5, 6, 7], prompt="p")
                       for j in range(2)] for g in range(16)]

            async def reward(samples):
                return None

            async def kill_when_in_flight():
                while pool.inflight[url] < 32:
                    await asyncio.sleep(0.02)
                os.kill(proc.pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait)

            killer = asyncio.ensure_future(kill_when_in_flight())
            try:
                with pytest.raises(EngineError) as err:
                    await generate_batch(args, lambda: groups, 16, {"max_new_tokens": 4}, default_generate, reward, None,
                                         max_rounds=1)
            finally:
                await killer
                await pool.close()
            message = str(err.value)
            del err  # its traceback holds the finished tasks; collected, an unretrieved one would complain
            gc.collect()
            return message

        try:
            message = asyncio.run(main())
            gc.collect()
        finally:
            logger.removeHandler(rec)
    finally:
        proc.kill()
        proc.wait()
    said = f"engine engine-0-1 at {url}: its process (pid {proc.pid}) died; its log: {log_path}"
    assert said in message, message
    assert len(rec.lines) == 1 and said in rec.lines[0], rec.lines  # once, not once per request in flight
    assert not [m for m in unretrieved if "never retrieved" in m], unretrieved


# ----------------------------------------------------------------------------- the harness's event loop


def _tiny_chat_tokenizer():
    """A real (fast) tokenizer with a chat template, built in milliseconds: whitespace words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<|im_end|>", "hello", "world", "user:"])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>")
    tok.chat_template = "{% for m in messages %}user: {{ m['content'] }} {% endfor %}"
    return tok


class _ThreadRecorder:
    """The tokenizer, recording which thread renders and encodes (it delegates everything)."""

    def __init__(self, tok):
        self._tok, self.threads = tok, []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def apply_chat_template(self, *args, **kwargs):
        import threading

        self.threads.append(("render", threading.get_ident()))
        return self._tok.apply_chat_template(*args, **kwargs)

    def encode(self, *args, **kwargs):
        import threading

        self.threads.append(("encode", threading.get_ident()))
        return self._tok.encode(*args, **kwargs)


def test_the_harness_tokenises_long_messages_off_the_event_loop():
    import asyncio
    import threading

    from aiohttp.test_utils import TestClient, TestServer

    from slimectl.agents.harness import Harness
    from slimectl.engines.pool import EnginePool

    tok = _ThreadRecorder(_tiny_chat_tokenizer())

    async def main():
        loop_thread = threading.get_ident()
        pool = EnginePool(["http://127.0.0.1:9"])  # nothing listens: the request fails after tokenising
        harness = Harness(pool, tok, "tiny")
        async with TestClient(TestServer(harness.app)) as client:
            resp = await client.post("/sessions/s1/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hello world " * 50_000}]})
            assert resp.status >= 500, await resp.text()  # no engine: but the prompt was tokenised first
        await pool.close()
        return loop_thread

    loop_thread = asyncio.run(main())
    assert {what for what, _ in tok.threads} == {"render", "encode"}, tok.threads
    assert all(ident != loop_thread for _, ident in tok.threads), "tokenised on the event loop"


# ----------------------------------------------------------------------------- smaller ones (bug 9)


def test_the_buffer_and_import_refuse_a_negative_group_index():
    from slimectl.contract.errors import SlimectlError
    from slimectl.contract.samples import Sample
    from slimectl.contract.sample_checks import check_sample

    s = Sample(group_index=-3, index=0, rollout_id=0, tokens=[5, 6, 7], prompt="p")
    s.append_response_tokens([8], [-0.1], True, {})
    s.reward = 1.0
    with pytest.raises(SlimectlError, match="trajectory 0: group_index must be >= 0, got -3"):
        check_sample("trajectory 0", s, None, None)
    s.group_index = 3
    check_sample("trajectory 0", s, None, None)


def test_serve_on_all_interfaces_without_a_token_warns(run_dir, fake_model, monkeypatch):
    import socket

    from slimectl.contract.config import apply_overrides, build_config
    from slimectl.contract.errors import UsageError
    from slimectl.stages.serve import EngineProcesses

    with socket.socket() as held:  # engine.port is taken: start() stops right after its checks
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cfg = run_dir.config()
        cfg = build_config(apply_overrides(cfg.to_dict(), ["engine.host=0.0.0.0", f"engine.port={port}"]), "test")
        monkeypatch.delenv(cfg.engine.token_env, raising=False)
        rec, logger = _Records(), logging.getLogger("slimectl")
        logger.addHandler(rec)
        try:
            with pytest.raises(UsageError, match="already in use"):
                EngineProcesses(run_dir, cfg).start()
        finally:
            logger.removeHandler(rec)
    warned = [line for line in rec.lines if "without a token" in line]
    assert len(warned) == 1 and "0.0.0.0" in warned[0] and cfg.engine.token_env in warned[0], rec.lines
