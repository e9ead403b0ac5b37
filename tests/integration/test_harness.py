"""slimectl harness: an OpenAI-compatible chat endpoint over a real embedded engine, driven with
plain HTTP through multi-turn sessions; the recorded tokens, masks and log-probs are checked
against direct engine calls, and the export is imported into a run."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import Sample
from tests.helpers import ENV, free_port, start_engine, wait_healthy

pytestmark = pytest.mark.xdist_group("harness")  # xdist: one worker, fixtures built once

KEY = "harness-test-key"
Q1, Q2, Q3 = "What is 2 + 3?", "And 4 + 4?", "Thanks. What is 7 * 6?"


def call(method: str, url: str, body=None, headers=None, key: str | None = KEY, raw: bytes | None = None):
    """(status, JSON body, response headers) of one plain HTTP request."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read() or b"null"), resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null"), exc.headers


def make_eos_reachable(model_dir: Path, tok, question: str) -> None:
    """Make greedy decoding end its first reply with <|im_end|> after a few tokens.

    A random tiny model almost never samples eos. Copying (and scaling) the output-embedding row
    of a token greedy picks early into eos's row makes eos win there, while every other logit
    (and so the context dependence the log-prob checks rely on) stays as it was.
    """
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
        logits = model(out).logits[0, len(ids) - 1:]
    greedy = out[0, len(ids):].tolist()
    k = next(i for i in range(1, 4) if logits[i, greedy[i]] > 0)
    path = model_dir / "model.safetensors"
    state = load_file(path)
    state["lm_head.weight"][tok.eos_token_id] = 1.5 * state["lm_head.weight"][greedy[k]]
    save_file(state, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def world(tmp_path_factory, cli_module):
    from transformers import AutoTokenizer

    from slimectl.starter_models.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("harness")
    model = build_tiny_model("qwen2", root / "model", seed=7, tie_word_embeddings=False, initializer_range=0.3)
    tok = AutoTokenizer.from_pretrained(model)
    make_eos_reachable(model, tok, Q1)
    engine, engine_url = start_engine(model, root / "engine.log")
    res = cli_module("init", root / "run", "--set", f"model.path={model}")
    assert res.exit_code == 0, res.output
    run = RunDir.open(root / "run")
    wait_healthy(engine_url)
    out = root / "sessions.jsonl"
    harness = subprocess.Popen([sys.executable, "-m", "slimectl", "harness", "-r", str(run.path), "--engine-url",
                                engine_url, "--out", str(out), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=open(root / "harness.log", "w"), text=True,
                               env={**ENV, "SLIMECTL_HARNESS_API_KEY": KEY})
    deadline = time.time() + 120
    line = ""
    while time.time() < deadline and not line:
        ready, _, _ = select.select([harness.stdout], [], [], 1.0)
        if ready:
            line = harness.stdout.readline()
            break
        if harness.poll() is not None:
            break
    assert line.startswith("http://127.0.0.1:"), (root / "harness.log").read_text()
    base = line.strip()[: -len("/v1")]
    yield {"base": base, "engine": engine_url, "tok": tok, "run": run, "out": out, "root": root}
    harness.send_signal(signal.SIGTERM)
    assert harness.wait(timeout=30) == 0, (root / "harness.log").read_text()
    engine.kill()
    engine.wait()


@pytest.fixture(scope="module")
def cli_module():
    from click.testing import CliRunner

    from slimectl.commands.cli import cli as root

    def run(*args):
        return CliRunner().invoke(root, [str(a) for a in args], prog_name="slimectl", catch_exceptions=False)

    return run


def render(tok, messages) -> str:
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def engine_generate(world, input_ids, **params):
    """What the engine itself answers for these tokens: (output ids, their log-probs)."""
    _, out, _ = call("POST", world["engine"] + "/generate", {"input_ids": input_ids, "return_logprob": True,
                                                            "sampling_params": params}, key=None)
    return out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]]


def teacher_forced(world, tokens):
    """The engine's log-prob of every token given all before it (None for the first)."""
    _, out, _ = call("POST", world["engine"] + "/generate", {
        "input_ids": tokens, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}}, key=None)
    return [x[0] for x in out["meta_info"]["input_token_logprobs"]]


def chat(world, messages, session=None, base=None, **params):
    headers = {"X-Session-Id": session} if session else {}
    status, body, hdrs = call("POST", (base or world["base"]) + "/v1/chat/completions",
                              {"model": "tiny", "messages": messages, **params}, headers)
    assert status == 200, body
    return body, hdrs


def session(world, sid):
    status, body, _ = call("GET", f"{world['base']}/sessions/{sid}")
    assert status == 200, body
    return [Sample.from_dict(s) for s in body["samples"]]


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def pick_stop_string(tok, ids):
    """A stop string that ends generation exactly at a token boundary after at least one token."""
    for j in range(1, len(ids)):
        piece = decode(tok, ids[j:j + 1])
        before = decode(tok, ids[:j])
        if set(ids[: j + 1]) & set(tok.all_special_ids) or not piece.strip():
            continue
        if decode(tok, ids[: j + 1]).find(piece) == len(before):
            return j, piece
    raise AssertionError(f"no usable stop string in {ids}")


def test_multi_turn_session_records_the_exact_tokens_masks_and_logprobs(world):
    tok, eos = world["tok"], world["tok"].eos_token_id
    msgs1 = [{"role": "user", "content": Q1}]
    t1 = render(tok, msgs1)
    # turn 1: greedy; the model ends its reply with <|im_end|> (kept, trained on)
    want1, lp1 = engine_generate(world, enc(tok, t1), temperature=0, max_new_tokens=6)
    assert eos in want1, "the fixture should make greedy decoding stop on eos"
    want1 = want1[: want1.index(eos) + 1]
    r1, hdrs = chat(world, msgs1, session="ep-1", temperature=0, max_tokens=6)
    assert set(r1) == {"id", "object", "created", "model", "choices", "usage"} and r1["object"] == "chat.completion"
    assert r1["id"].startswith("chatcmpl-") and isinstance(r1["created"], int) and r1["model"] == "tiny"
    (choice,) = r1["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop" and choice["message"]["role"] == "assistant"
    c1 = choice["message"]["content"]
    assert c1 == decode(tok, want1[:-1])
    assert r1["usage"] == {"prompt_tokens": len(enc(tok, t1)), "completion_tokens": len(want1),
                           "total_tokens": len(enc(tok, t1)) + len(want1)}
    assert hdrs["X-Session-Id"] == "ep-1" and hdrs["X-Slimectl-Segment"] == "0" and hdrs["X-Slimectl-Turn"] == "1"

    # turn 2: the history holds the reply; a stop string ends the reply and is left out of the history
    msgs2 = msgs1 + [{"role": "assistant", "content": c1}, {"role": "user", "content": Q2}]
    t2 = render(tok, msgs2)
    done1 = t1 + c1 + "<|im_end|>"
    assert t2.startswith(done1)
    obs2 = enc(tok, t2[len(done1):])
    prefix2 = enc(tok, t1) + want1 + obs2
    greedy2, _ = engine_generate(world, prefix2, temperature=0, max_new_tokens=8, ignore_eos=True)
    j, stop = pick_stop_string(tok, greedy2)
    want2, lp2 = engine_generate(world, prefix2, temperature=0, max_new_tokens=8, stop=[stop])
    assert want2 == greedy2[: j + 1]
    r2, hdrs = chat(world, msgs2, session="ep-1", temperature=0, max_tokens=8, stop=stop)
    assert r2["choices"][0]["finish_reason"] == "stop" and hdrs["X-Slimectl-Turn"] == "2"
    c2 = r2["choices"][0]["message"]["content"]
    assert c2 == decode(tok, want2[:j])
    (mid,) = session(world, "ep-1")
    assert mid.response_tokens == want1 + obs2 + want2  # the stop string is still there...

    # turn 3: ...and is dropped now that the agent's history continues without it
    msgs3 = msgs2 + [{"role": "assistant", "content": c2}, {"role": "user", "content": Q3}]
    t3 = render(tok, msgs3)
    done2 = t2 + c2
    assert t3.startswith(done2)
    obs3 = enc(tok, t3[len(done2):])
    prefix3 = prefix2 + want2[:j] + obs3
    want3, lp3 = engine_generate(world, prefix3, temperature=0, max_new_tokens=3)
    r3, _ = chat(world, msgs3, session="ep-1", temperature=0, max_completion_tokens=3)
    assert r3["usage"]["prompt_tokens"] == len(prefix3) and r3["usage"]["completion_tokens"] == len(want3)
    assert r3["choices"][0]["finish_reason"] == ("stop" if want3[-1] == eos else "length")

    (s,) = session(world, "ep-1")
    assert s.tokens == prefix3 + want3
    assert s.prompt_tokens == enc(tok, t1) and s.prompt == msgs1
    # the recorded tokens are the rendering of the whole conversation, model text as generated
    assert decode(tok, s.tokens) == t3 + decode(tok, want3)
    assert s.loss_mask == [1] * len(want1) + [0] * len(obs2) + [1] * j + [0] * len(obs3) + [1] * len(want3)
    model_lps = lp1[: len(want1)] + lp2[:j] + lp3
    got = [lp for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m]
    assert got == pytest.approx(model_lps, abs=1e-6)
    assert all(lp == 0.0 for lp, m in zip(s.rollout_log_probs, s.loss_mask) if not m)
    # the engine, teacher-forced on the recorded tokens, gives the recorded log-probs: the model
    # really saw exactly these tokens as context
    forced = teacher_forced(world, s.tokens)[s.prompt_length:]
    for lp, f, m in zip(s.rollout_log_probs, forced, s.loss_mask):
        if m:
            assert lp == pytest.approx(f, abs=2e-4)
    turns = s.metadata["turns"]
    assert [t["trimmed_tokens"] for t in turns] == [0, 1, 0] and s.weight_versions == ["0"] * 3
    assert s.metadata["segment_start"]["reason"] == "first request of the session"
    assert s.metadata["messages"][-1] == {"role": "assistant", "content": r3["choices"][0]["message"]["content"]}


def test_sessions_are_separate_and_an_edited_history_starts_a_new_segment(world):
    tok = world["tok"]
    a1 = [{"role": "user", "content": "Hello there."}]
    b1 = [{"role": "user", "content": "What is 9 + 1?"}]
    # session "a" through a per-session base URL, session "b" through the body's `user` field
    base_a = world["base"] + "/sessions/a"
    ra1, _ = chat(world, a1, base=base_a, temperature=1.0, seed=3, max_tokens=4)
    rb1, _ = chat(world, b1, user="b", temperature=1.0, seed=4, max_tokens=4)
    a2 = a1 + [{"role": "assistant", "content": ra1["choices"][0]["message"]["content"]},
               {"role": "user", "content": "More?"}]
    ra2, _ = chat(world, a2, base=base_a, temperature=1.0, seed=5, max_tokens=4)
    # "b" rewrites its first question: the recorded tokens cannot be continued
    b2 = [{"role": "user", "content": "What is 9 + 2?"},
          {"role": "assistant", "content": rb1["choices"][0]["message"]["content"]},
          {"role": "user", "content": "Sure?"}]
    rb2, hdrs = chat(world, b2, user="b", temperature=1.0, seed=6, max_tokens=4)
    assert hdrs["X-Slimectl-Segment"] == "1" and hdrs["X-Slimectl-Turn"] == "1"

    (sa,) = session(world, "a")
    assert len(sa.metadata["turns"]) == 2
    ta2 = render(tok, a2)
    assert decode(tok, sa.tokens).startswith(ta2) and "9 + 1" not in decode(tok, sa.tokens)
    assert sa.response_length == len(sa.tokens) - len(enc(tok, render(tok, a1)))

    b_first, b_second = session(world, "b")
    assert decode(tok, b_first.prompt_tokens) == render(tok, b1) and b_first.loss_mask == [1] * b_first.response_length
    assert b_second.prompt_tokens == enc(tok, render(tok, b2)) and b_second.prompt == b2
    assert b_second.loss_mask == [1] * rb2["usage"]["completion_tokens"] and "Hello" not in decode(tok, b_second.tokens)
    start = b_second.metadata["segment_start"]
    assert "does not extend" in start["reason"] and start["after_segment"] == 0
    assert start["recorded"].startswith("1?") and start["requested"].startswith("2?")
    assert b_second.metadata["segment"] == 1 and b_second.metadata["num_segments"] == 2

    status, listing, _ = call("GET", world["base"] + "/sessions")
    assert status == 200 and {"id": "b", "segments": 2, "turns": 2, "finished": False, "published": False} \
        in listing["sessions"]


@pytest.mark.parametrize("path, body, headers, key, status, message", [
    ("/v1/chat/completions", {"model": "m"}, {"X-Session-Id": "x"}, KEY, 400, "'messages' is required"),
    ("/v1/chat/completions", {"messages": []}, {"X-Session-Id": "x"}, KEY, 400, "non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"},
     {"X-Session-Id": "x"}, KEY, 400, "stream must be true or false"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream_options": {}},
     {"X-Session-Id": "x"}, KEY, 400, "stream_options is only allowed with stream=true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 17},
     {"X-Session-Id": "x"}, KEY, 400, "n must be an integer in [1, 16]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True},
     {"X-Session-Id": "x"}, KEY, 400, "n > 1 is answered whole"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
     {"X-Session-Id": "x"}, KEY, 400, "temperature must be a number in [0, 2]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, {}, KEY, 400,
     "no session id: send the header X-Session-Id"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "hi"}]}, {"X-Session-Id": "x"}, KEY, 400,
     "a message with role 'tool' must answer a preceding assistant message with 'tool_calls'"),
    ("/v1/chat/completions", {"messages": [{"role": "developer", "content": "hi"}]}, {"X-Session-Id": "x"}, KEY,
     400, "chat template refused these messages: Unsupported chat role: developer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, {"X-Session-Id": "x"}, "wrong", 401,
     "Incorrect or missing API key"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, {"X-Session-Id": "x"}, None, 401,
     "Incorrect or missing API key"),
    ("/sessions/nobody/finish", {"reward": 1.0}, {}, KEY, 404, "no session 'nobody'"),
    ("/v1/completions", {"prompt": "hi"}, {}, KEY, 404, "no endpoint POST /v1/completions"),
])
def test_bad_requests_get_a_clear_4xx(world, path, body, headers, key, status, message):
    got, out, _ = call("POST", world["base"] + path, body, headers, key=key)
    assert got == status, out
    assert message in out["error"]["message"] and out["error"]["type"] == "invalid_request_error"
    assert all(s["id"] != "x" for s in call("GET", world["base"] + "/sessions")[1]["sessions"])


def test_streaming_with_the_openai_client_records_what_a_whole_completion_would(world):
    from openai import OpenAI

    tok = world["tok"]
    client = OpenAI(base_url=world["base"] + "/v1", api_key=KEY, max_retries=0)
    msgs = [{"role": "user", "content": Q1}]
    kw = {"model": "tiny", "messages": msgs, "temperature": 0, "max_tokens": 6}
    whole = client.chat.completions.create(**kw, extra_headers={"X-Session-Id": "s-whole"})
    raw = client.chat.completions.with_raw_response.create(**kw, stream=True, stream_options={"include_usage": True},
                                                           extra_headers={"X-Session-Id": "s-stream"})
    assert raw.headers["content-type"].startswith("text/event-stream") and raw.headers["X-Slimectl-Turn"] == "1"
    chunks = list(raw.parse())
    assert chunks[0].choices[0].delta.role == "assistant" and len({c.id for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    want, lps = engine_generate(world, enc(tok, render(tok, msgs)), temperature=0, max_new_tokens=6)
    (a,), (b,) = session(world, "s-whole"), session(world, "s-stream")
    assert b.response_tokens == want == a.response_tokens and b.loss_mask == a.loss_mask
    assert b.rollout_log_probs == pytest.approx(lps, abs=1e-6)
    # a streamed second turn (no usage asked) continues the same segment, as a whole one would
    msgs2 = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": Q2}]
    kw2 = {**kw, "messages": msgs2, "max_tokens": 5}
    chunks2 = list(client.chat.completions.create(**kw2, stream=True, extra_headers={"X-Session-Id": "s-stream"}))
    whole2 = client.chat.completions.create(**kw2, extra_headers={"X-Session-Id": "s-whole"})
    assert all(c.choices for c in chunks2) and chunks2[-1].choices[0].finish_reason == whole2.choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks2) == whole2.choices[0].message.content
    (a2,), (b2,) = session(world, "s-whole"), session(world, "s-stream")
    assert len(b2.metadata["turns"]) == 2 and b2.tokens[: len(b.tokens)] == b.tokens and b2.tokens == a2.tokens
    assert decode(tok, b2.tokens).startswith(render(tok, msgs2))


def test_the_responses_api_with_the_openai_client_records_what_chat_completions_would(world):
    from openai import OpenAI

    tok = world["tok"]
    client = OpenAI(base_url=world["base"] + "/v1", api_key=KEY, max_retries=0)
    msgs = [{"role": "user", "content": Q1}]
    via_chat = client.chat.completions.create(model="tiny", messages=msgs, temperature=0, max_tokens=6,
                                              extra_headers={"X-Session-Id": "rs-chat"})
    kw = {"model": "tiny", "input": Q1, "temperature": 0, "max_output_tokens": 6}
    whole = client.responses.create(**kw, extra_headers={"X-Session-Id": "rs-whole"})
    events = list(client.responses.create(**kw, stream=True, extra_headers={"X-Session-Id": "rs-stream"}))
    assert whole.status == "completed" and whole.output_text == via_chat.choices[0].message.content
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (via_chat.usage.prompt_tokens,
                                                                     via_chat.usage.completion_tokens)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type == "response.completed" and events[-1].response.output_text == text == whole.output_text
    want, lps = engine_generate(world, enc(tok, render(tok, msgs)), temperature=0, max_new_tokens=6)
    for sid in ("rs-chat", "rs-whole", "rs-stream"):
        (s,) = session(world, sid)
        assert s.response_tokens == want and s.rollout_log_probs == pytest.approx(lps, abs=1e-6), sid
    # the next turn, the earlier output items sent back as input, continues the same segment
    follow = [{"role": "user", "content": Q1}, *[o.model_dump(exclude_none=True) for o in whole.output],
              {"role": "user", "content": Q2}]
    client.responses.create(model="tiny", input=follow, temperature=0, max_output_tokens=1,
                            extra_headers={"X-Session-Id": "rs-whole"})
    (s2,) = session(world, "rs-whole")
    assert len(s2.metadata["turns"]) == 2 and s2.tokens[: len(s.tokens)] == s.tokens
    assert s2.loss_mask.count(1) == len(want) + 1
    cut = client.responses.create(model="tiny", input="Tell me a long story.", max_output_tokens=1, temperature=0,
                                  extra_headers={"X-Session-Id": "rs-cut"})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_logprobs_are_the_engines_own_whole_and_streamed(world):
    from openai import OpenAI

    tok = world["tok"]
    client = OpenAI(base_url=world["base"] + "/v1", api_key=KEY, max_retries=0)
    msgs = [{"role": "user", "content": "Name a color."}]
    kw = {"model": "tiny", "messages": msgs, "temperature": 0, "max_tokens": 5, "logprobs": True}
    want, lps = engine_generate(world, enc(tok, render(tok, msgs)), temperature=0, max_new_tokens=5)
    kept = len(want) - (want[-1] == tok.eos_token_id)  # a stop token is not content
    r = client.chat.completions.create(**kw, extra_headers={"X-Session-Id": "lp-whole"})
    got = r.choices[0].logprobs.content
    assert [x.logprob for x in got] == pytest.approx(lps[:kept], abs=1e-6) and len(got) == kept
    assert "".join(x.token for x in got) == r.choices[0].message.content == decode(tok, want[:kept])
    assert all(x.top_logprobs == [] and bytes(x.bytes).decode() == x.token for x in got)
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_headers={"X-Session-Id": "lp-stream"}))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [x.model_dump() for x in streamed] == [x.model_dump() for x in got]
    (s,) = session(world, "lp-stream")
    assert s.rollout_log_probs[:kept] == pytest.approx([x.logprob for x in got], abs=1e-6)


def test_n_completions_are_each_recorded_and_the_next_turn_continues_the_chosen_one(world):
    tok = world["tok"]
    msgs = [{"role": "user", "content": "Say something."}]
    r1, _ = chat(world, msgs, session="n-ep", temperature=1.0, seed=11, max_tokens=4)
    msgs2 = msgs + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "Go on."}]
    r2, hdrs = chat(world, msgs2, session="n-ep", temperature=1.0, seed=20, max_tokens=4, n=3)
    assert [c["index"] for c in r2["choices"]] == [0, 1, 2] and hdrs["X-Slimectl-Segment"] == "0"
    prefix = enc(tok, render(tok, msgs2))
    outs = [engine_generate(world, prefix, temperature=1.0, max_new_tokens=4, sampling_seed=20 + i)[0]
            for i in range(3)]
    assert r2["usage"]["completion_tokens"] == sum(map(len, outs))
    segs = session(world, "n-ep")
    assert len(segs) == 3 and [s.tokens[len(prefix):] for s in segs] == outs
    assert all(s.tokens[: len(prefix)] == prefix for s in segs)
    n1 = r1["usage"]["completion_tokens"]
    assert segs[0].loss_mask.count(1) == n1 + len(outs[0])  # the first turn is trained once, in segment 0
    assert segs[2].loss_mask.count(1) == len(outs[2]) and segs[2].metadata["segment_start"]["choice"] == 2
    # the agent goes on with choice 2: the next turn continues that copy
    msgs3 = msgs2 + [{"role": "assistant", "content": r2["choices"][2]["message"]["content"]},
                     {"role": "user", "content": "Thanks."}]
    _, hdrs = chat(world, msgs3, session="n-ep", temperature=1.0, max_tokens=2)
    assert hdrs["X-Slimectl-Segment"] == "2" and hdrs["X-Slimectl-Turn"] == "3"


def test_a_stream_cut_by_the_client_records_nothing(world):
    import socket
    import struct
    from urllib.parse import urlsplit

    msgs = [{"role": "user", "content": "Tell me a long story."}]
    body = json.dumps({"messages": msgs, "stream": True, "max_tokens": 64, "temperature": 0}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer {KEY}\r\n"
            f"X-Session-Id: cut\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    url = urlsplit(world["base"])
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(head.encode() + body)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # a reset while the engine generates
    deadline = time.time() + 60
    while "the client closed the stream" not in (world["root"] / "harness.log").read_text():
        assert time.time() < deadline, (world["root"] / "harness.log").read_text()
        time.sleep(0.1)
    status, out, _ = call("GET", world["base"] + "/sessions/cut")
    assert status == 404 and out["error"]["code"] == "session_not_found"
    # the agent sends the same request again: it is the session's first turn
    _, hdrs = chat(world, msgs, session="cut", temperature=0, max_tokens=64)
    assert hdrs["X-Slimectl-Segment"] == "0" and hdrs["X-Slimectl-Turn"] == "1"
    (s,) = session(world, "cut")
    assert len(s.metadata["turns"]) == 1 and s.prompt == msgs


def test_finish_rules_models_and_health(world):
    status, out, _ = call("POST", world["base"] + "/v1/chat/completions", raw=b"{not json", headers={"X-Session-Id": "z"})
    assert status == 400 and "not valid JSON" in out["error"]["message"]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    chat(world, [{"role": "user", "content": "hi"}], session="fin", max_tokens=2, tools=tools)
    status, out, _ = call("POST", world["base"] + "/sessions/fin/finish", {"reward": "good"})
    assert status == 400 and "reward must be a finite number" in out["error"]["message"]
    status, out, _ = call("POST", world["base"] + "/sessions/fin/finish", {"reward": 1, "metadata": {"turns": 3}})
    assert status == 400 and "written by the harness" in out["error"]["message"]
    status, out, _ = call("POST", world["base"] + "/sessions/fin/finish", {"reward": 1, "label": "ok"})
    assert status == 200 and out == {"id": "fin", "finished": True, "samples": 1}
    status, out, _ = call("POST", world["base"] + "/sessions/fin/finish", {"reward": 1})
    assert status == 409 and "already finished" in out["error"]["message"]
    status, out, _ = call("POST", world["base"] + "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "hi"}]}, {"X-Session-Id": "fin"})
    assert status == 409 and "use a new session id" in out["error"]["message"]
    status, out, _ = call("GET", world["base"] + "/v1/models")
    assert status == 200 and out["object"] == "list" and out["data"][0]["id"] == "model"
    assert out["data"][0]["object"] == "model"
    status, out, _ = call("GET", world["base"] + "/health", key=None)
    assert status == 200 and out["status"] == "ok"


def test_finished_sessions_export_to_a_file_that_rollout_import_accepts(world, cli_module):
    tok, run = world["tok"], world["run"]
    for sid, reward in (("g-0", 1.0), ("g-1", 0.0)):
        r, _ = chat(world, [{"role": "user", "content": "Name a number."}], session=sid, temperature=1.0, max_tokens=3)
        chat(world, [{"role": "user", "content": "Name a number."},
                     {"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Another."}], session=sid, temperature=1.0, max_tokens=3)
        status, out, _ = call("POST", f"{world['base']}/sessions/{sid}/finish",
                              {"reward": reward, "group": "numbers", "metadata": {"task": "numbers"}})
        assert status == 200, out
    # a session finished with a label (this test's own: it must not depend on which tests ran before it)
    chat(world, [{"role": "user", "content": "hi"}], session="labelled", max_tokens=2)
    status, out, _ = call("POST", world["base"] + "/sessions/labelled/finish", {"reward": 1, "label": "ok"})
    assert status == 200, out
    lines = [json.loads(x) for x in world["out"].read_text().splitlines()]
    by_session = {x["metadata"]["session_id"]: x for x in lines}
    assert by_session["g-0"]["group_index"] == by_session["g-1"]["group_index"]
    assert by_session["g-0"]["reward"] == 1.0 and by_session["g-0"]["metadata"]["task"] == "numbers"
    assert by_session["labelled"]["label"] == "ok"
    assert [x["index"] for x in lines] == list(range(len(lines)))
    g0 = Sample.from_dict(by_session["g-0"])
    assert g0.tokens == session(world, "g-0")[0].tokens and g0.response == decode(tok, g0.response_tokens)

    before = run.rollouts.ids()
    res = cli_module("rollout", "import", world["out"], "-r", run.path)
    assert res.exit_code == 0, res.output
    rid = run.rollouts.ids()[-1]
    assert rid not in before
    from slimectl.contract.samples import SAMPLES_FILE, read_samples

    imported = read_samples(run.rollouts.get(rid).file(SAMPLES_FILE))
    assert [s.tokens for s in imported] == [x["tokens"] for x in lines]
    assert [s.loss_mask for s in imported] == [x["loss_mask"] for x in lines]

    # the same sessions, published straight into the run through the importer
    status, out, _ = call("POST", world["base"] + "/publish")
    assert status == 200, out
    assert out["rollout_id"] == rid + 1 and out["num_samples"] == len(lines) and Path(out["file"]).is_file()
    art = run.rollouts.get(out["rollout_id"])
    assert art.meta["source"] == "import" and art.meta["num_samples"] == len(lines)
    status, out, _ = call("POST", world["base"] + "/publish")
    assert status == 409 and "no finished, unpublished sessions" in out["error"]["message"]


def test_cli_refuses_missing_engines_or_model_and_an_existing_out_file(world, cli_module, tmp_path):
    out = tmp_path / "t.jsonl"
    res = cli_module("harness", "--out", out)
    assert res.exit_code == 2 and "no engines: pass --engine-url URL" in res.output
    res = cli_module("harness", "--engine-url", world["engine"], "--out", out)
    assert res.exit_code == 2 and "pass --model HF_DIR" in res.output
    out.write_text('{"tokens": [1]}\n')
    res = cli_module("harness", "--engine-url", world["engine"], "--model", world["root"] / "model", "--out", out)
    assert res.exit_code == 2 and "already holds recorded sessions" in res.output
    assert out.read_text() == '{"tokens": [1]}\n'
    res = cli_module("harness", "--engine-url", f"http://127.0.0.1:{free_port()}", "--model", world["root"] / "model",
                     "--out", tmp_path / "u.jsonl")
    assert res.exit_code == 1 and "none of the engines answered" in res.output
