"""Multi-turn rollouts with tools: token accounting, limits and the sandboxed python tool.

The engine tests use a real embedded engine serving a tiny Qwen2 that was first made to memorise
a few tool-using transcripts (a few seconds of Adam on CPU), so that greedy decoding really
emits ``<tool_call>`` blocks: the model, the engine, the tool subprocesses and the chat template
are all real.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from slimectl.agents.multiturn import (
    ChatTurnFormat,
    Observation,
    final_text,
    make_generate,
    python_tool_env,
)
from slimectl.agents.tools import ToolEnvironment, make_tool_env_factory, parse_tool_calls
from slimectl.agents.tools.python_tool import PythonTool
from slimectl.contract.samples import Sample, Status, read_samples, write_samples
from tests.helpers import ROOT, start_engine, wait_healthy

pytestmark = pytest.mark.xdist_group("multiturn")  # xdist: one worker, fixtures built once

EXAMPLE = ROOT / "examples" / "tool_math"


def call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


# prompt -> the first assistant turn the model memorises
FIRST_TURNS = {
    "What is 1234 * 5678?": call("print(1234 * 5678)"),
    "Loop forever.": call("while True: pass"),
    "Divide by zero.": call("print(1 / 0)"),
    "Print a lot.": call("print('ab' * 3000)"),
    "Broken call.": '<tool_call>{"name": "python", "arguments": </tool_call>',
    "Use memory.": call("x = bytearray(1 << 30)"),
}
ANSWER = "\\boxed{7006652}"
GREEDY = {"temperature": 0.0, "max_new_tokens": 400}


# --------------------------------------------------------------------------- no engine needed


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from slimectl.starter_models.tiny_models import build_tokenizer

    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return AutoTokenizer.from_pretrained(d)


def test_turn_deltas_tokenize_to_exactly_the_full_chat_template(tokenizer):
    """Prompt + model tokens + observation deltas == tokenize(render(whole conversation))."""
    fmt = ChatTurnFormat(tokenizer)
    assert fmt.closer == "<|im_end|>\n" and not fmt.native_tool_role  # the tiny template refuses role "tool"
    eos = tokenizer.eos_token_id
    user = {"role": "user", "content": "What is 12 * 34?"}
    turns = [(call("print(12 * 34)"), ["408"]), (call("print(1)") + call("print(2)"), ["1", "2"]), ("\\boxed{408}", None)]
    tokens = tokenizer.encode(tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    messages = [user]
    for content, results in turns:
        tokens += tokenizer.encode(content, add_special_tokens=False) + [eos]  # as the model would emit them
        messages.append({"role": "assistant", "content": content})
        if results is None:
            break
        tokens += tokenizer.encode(fmt.between_turns(Observation(text=results), "<|im_end|>"), add_special_tokens=False)
        messages.append({"role": "user", "content": "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)})
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.encode(full, add_special_tokens=False) == tokens + tokenizer.encode("\n", add_special_tokens=False)
    # a turn stopped by a stop string (no EOS emitted) gets the whole end-of-turn marker, untrained
    assert fmt.between_turns(Observation(text="x")).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\nx\n")
    # a simulated user answers in its own role
    assert fmt.between_turns(Observation(text="hi", role="user"), "<|im_end|>") == (
        "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_with_a_tool_role_is_used_natively(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                         "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    fmt = ChatTurnFormat(tok)
    assert fmt.native_tool_role
    assert fmt.between_turns(Observation(text=["a", "b"]), "<|im_end|>") == (
        "\n<|im_start|>tool\na<|im_end|>\n<|im_start|>tool\nb<|im_end|>\n<|im_start|>assistant\n")
    tok.chat_template = None
    with pytest.raises(Exception, match="chat template"):
        ChatTurnFormat(tok)


def test_parse_tool_calls_in_order_with_clear_errors():
    p = parse_tool_calls("think " + call("print(1)") + " then <tool_call>{bad json}</tool_call>"
                         '<tool_call>{"name": "calc", "arguments": "{\\"x\\": 1}"}</tool_call>'
                         '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "f", "arguments": [1]}</tool_call>'
                         "<tool_call>{\"name\": \"x\"")
    kinds = [b if isinstance(b, str) else (b.name, b.arguments) for b in p.blocks]
    assert kinds[0] == ("python", {"code": "print(1)"})
    assert kinds[1].startswith("Error: the tool call is not valid JSON")
    assert kinds[2] == ("calc", {"x": 1})  # JSON-encoded arguments are accepted
    assert '"name" string' in kinds[3] and "must be a JSON object" in kinds[4]
    assert kinds[5] == "Error: a <tool_call> block was not closed with </tool_call>."
    assert parse_tool_calls("The answer is \\boxed{3}.").blocks == []


def run(coro):
    return asyncio.run(coro)


def test_python_tool_runs_code_isolated_without_stdin_in_a_scratch_dir(monkeypatch):
    monkeypatch.setenv("SLIMECTL_TEST_SECRET", "do-not-leak")
    tool = PythonTool(timeout_s=5)
    code = ("import os, sys\nprint(1234 * 5678)\nprint(sys.flags.isolated, repr(sys.stdin.read()))\n"
            "print(os.getcwd().startswith(os.environ['TMPDIR']), 'SLIMECTL_TEST_SECRET' in os.environ)\n"
            "open('scratch.txt', 'w').write('x')\nprint(sorted(os.listdir('.')))")
    res = run(tool({"code": code}))
    assert res.status == "ok"
    assert res.text.splitlines() == ["7006652", "1 ''", "True False", "['scratch.txt', 'snippet.py']"]


def test_python_tool_time_limit_kills_the_whole_process_group(tmp_path):
    tool = PythonTool(timeout_s=1.0)
    marker = tmp_path / "child.pid"
    code = (f"import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(60)\nelse:\n"
            f"    open({str(marker)!r}, 'w').write(str(pid))\n    print('started', flush=True)\n    while True: pass")
    t0 = time.monotonic()
    res = run(tool({"code": code}))
    took = time.monotonic() - t0
    assert res.status == "timeout" and 1.0 <= took < 4.0, (res, took)
    assert res.text == "started\nError: the program ran longer than 1 s and was stopped."
    child = int(marker.read_text())
    for _ in range(100):  # SIGKILLed with the group; gone once init reaps it
        if not Path(f"/proc/{child}").exists() or "zombie" in Path(f"/proc/{child}/status").read_text():
            break
        time.sleep(0.02)
    else:
        pytest.fail(f"the forked child {child} survived the timeout")


def test_python_tool_memory_and_output_limits_and_crashes():
    tool = PythonTool(timeout_s=5, memory_mb=256, max_output_bytes=100)
    res = run(tool({"code": "x = bytearray(1 << 30)\nprint('allocated')"}))
    assert res.status == "memory" and "allocated" not in res.text  # the traceback's last line is cut off here...
    assert res.text.endswith("Error: the program ran out of memory (limit 256 MB).")  # ...but the status says it
    res = run(tool({"code": "print('é' * 1000)"}))  # 2001 bytes: the first 75 and the last 25 are kept
    assert res.status == "truncated"
    head, gap, tail, note = res.text.split("\n")
    assert head == "é" * 37 + "\ufffd" and gap == "[... 1901 bytes left out ...]" and tail == "é" * 12
    assert note == "[output truncated: the program printed 2001 bytes; 100 are shown]"
    t0 = time.monotonic()
    res = run(tool({"code": "while True: print('y' * 100)"}))
    assert res.status == "output_flood" and time.monotonic() - t0 < 3
    assert "printed more than 6400 bytes and was stopped" in res.text
    res = run(tool({"code": "def f():\n    raise ValueError('boom')\nf()"}))
    assert res.status == "error" and "ValueError: boom" in res.text and "bytes left out" in res.text
    res = run(PythonTool()({"code": "def f():\n    raise ValueError('boom')\nf()"}))
    assert 'File "snippet.py", line 3' in res.text and "ValueError: boom" in res.text
    assert "exec(" not in res.text  # the launcher's own frame is not shown
    assert res.text.endswith("Error: the program exited with code 1.")
    assert run(tool({"code": "import os; os.kill(os.getpid(), 9)"})).text == "Error: the program was killed by signal SIGKILL."
    assert run(tool({"code": "x = 1"})).text.startswith("(the program printed nothing")
    assert run(tool({"code": 5})).status == "bad_arguments"


def test_tool_environment_turns_tool_failures_into_observations():
    class Crashing:
        name = "crash"

        async def __call__(self, arguments):
            raise RuntimeError("disk on fire")

    class Slow:
        name = "slow"

        async def __call__(self, arguments):
            await asyncio.sleep(30)

    class NotText:
        name = "nottext"

        async def __call__(self, arguments):
            return 42

    env = ToolEnvironment([Crashing(), Slow(), NotText(), PythonTool(timeout_s=10)], timeout_s=0.3,
                          timeouts={"python": 0.5}, max_calls_per_turn=5)

    def tc(name, **args):
        return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"

    t0 = time.monotonic()
    obs = run(env.step(tc("crash") + tc("slow") + tc("nottext") + tc("nope") + "<tool_call>{oops</tool_call>"
                       + tc("python", code="import time; time.sleep(20)")))
    assert time.monotonic() - t0 < 5  # the python call was cancelled by the environment's 0.5 s limit
    assert not obs.done and [c["status"] for c in obs.info["tool_calls"]] == [
        "crash", "timeout", "crash", "unknown_tool", "malformed", "timeout"]
    assert obs.text[0] == "Error: tool 'crash' failed: RuntimeError: disk on fire"
    assert obs.text[1] == "Error: tool 'slow' did not answer within 0.3 s and was cancelled."
    assert obs.text[2] == "Error: tool 'nottext' returned int, not text."
    assert obs.text[3] == "Error: unknown tool 'nope'; available tools: crash, nottext, python, slow."
    final = run(env.step("So the answer is \\boxed{4}."))
    assert final.done and final.info["reason"] == "answered"
    capped = run(ToolEnvironment([NotText()], max_calls_per_turn=1).step(tc("nottext") + tc("nottext")))
    assert [c["status"] for c in capped.info["tool_calls"]] == ["crash", "skipped"]


def test_python_tool_cancelled_from_outside_leaves_no_process(tmp_path):
    tool = PythonTool(timeout_s=30)
    marker = tmp_path / "pid"

    async def go():
        task = asyncio.ensure_future(tool({"code": f"import os, time\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\n"
                                                   f"time.sleep(60)"}))
        for _ in range(200):
            if marker.exists() and marker.read_text():
                break
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(go())
    pid = int(marker.read_text())
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


# --------------------------------------------------------------------------- real engine


def memorise_transcripts(model_dir: Path, steps: int = 100):
    """Train the tiny model until greedy decoding reproduces every FIRST_TURNS turn (and the
    answer after the 1234 * 5678 tool result); returns (tokenizer, trained model).

    Measured (seed 3, torch seed 0): every memorised token is the argmax from step 80 on; at step 100
    the smallest logit margin of a memorised token over the runner-up is 4.3 (5.3 at step 160, the
    old count), far above the engine's float noise, at 60% of the CPU time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    fmt = ChatTurnFormat(tok)
    rows = []
    for q, first in FIRST_TURNS.items():
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        ids = tok.encode(prompt, add_special_tokens=False)
        mask = [0] * len(ids)
        turn = tok.encode(first, add_special_tokens=False) + [tok.eos_token_id]
        ids, mask = ids + turn, mask + [1] * len(turn)
        if q.startswith("What"):
            obs = tok.encode(fmt.between_turns(Observation(text="7006652"), "<|im_end|>"), add_special_tokens=False)
            turn = tok.encode(ANSWER, add_special_tokens=False) + [tok.eos_token_id]
            ids, mask = ids + obs + turn, mask + [0] * len(obs) + [1] * len(turn)
        rows.append((ids, mask))
    width = max(len(r[0]) for r in rows)
    x = torch.full((len(rows), width), tok.pad_token_id)
    m = torch.zeros(len(rows), width)
    att = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (ids, mask) in enumerate(rows):
        x[i, : len(ids)], m[i, : len(ids)], att[i, : len(ids)] = torch.tensor(ids), torch.tensor(mask, dtype=torch.float), 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        lp = torch.log_softmax(model(input_ids=x, attention_mask=att).logits[:, :-1], -1)
        lp = lp.gather(-1, x[:, 1:, None])[..., 0]
        loss = -(lp * m[:, 1:]).sum() / m[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        pred = model(input_ids=x, attention_mask=att).logits[:, :-1].argmax(-1)
    sel = m[:, 1:].bool()
    assert bool((pred[sel] == x[:, 1:][sel]).all()), f"memorisation failed (loss {loss.item():.4f})"
    model.save_pretrained(model_dir)
    return tok, model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("multiturn")
    model_dir = build_tiny_model("qwen2", root / "model", seed=3)  # max_position_embeddings 512
    tok, model = memorise_transcripts(model_dir)
    proc, url = start_engine(model_dir, root / "engine.log")
    try:
        wait_healthy(url)
        yield SimpleNamespace(url=url, tok=tok, model=model, model_dir=model_dir, root=root)
    finally:
        proc.kill()
        proc.wait()


class RecordingPool:
    """Passes every request to the real pool and keeps (request, response) for the checks."""

    def __init__(self, pool):
        self.pool, self.calls = pool, []

    async def generate(self, **body):
        out = await self.pool.generate(**body)
        self.calls.append((json.loads(json.dumps(body)), out))
        return out


def prompt_sample(tok, question: str, index: int = 0, **metadata) -> Sample:
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return Sample(index=index, group_index=index, prompt=text, tokens=tok.encode(text, add_special_tokens=False),
                  metadata=dict(metadata), label="7006652")


def episode(engine, question: str, env_factory=python_tool_env, params=GREEDY, sample: Sample | None = None,
            mask_offpolicy: bool = False, **options):
    """Run one multi-turn episode against the real engine; returns (sample, recorded engine calls)."""
    from slimectl.contract.config import build_config
    from slimectl.engines.pool import EnginePool

    async def go():
        pool = RecordingPool(EnginePool([engine.url]))
        args = SimpleNamespace(pool=pool, tokenizer=engine.tok, config=build_config({"model": {"path": str(engine.model_dir)}}),
                               mask_offpolicy=mask_offpolicy)
        try:
            s = sample or prompt_sample(engine.tok, question)
            return await make_generate(env_factory, **options)(args, s, dict(params)), pool.calls
        finally:
            await pool.pool.close()

    return asyncio.run(go())


def check_accounting(sample: Sample, calls, tok, prompt_len: int, trained_from: int = 0):
    """Token by token: every engine call saw exactly the token list so far; its output tokens follow
    with mask 1 and its log-probs; everything between two calls is a chat-template observation with
    mask 0 and log-prob 0; nothing else is in the sample."""
    sample.validate()
    pos = prompt_len
    resp = sample.response_length
    for i, (body, out) in enumerate(calls):
        assert body["input_ids"] == sample.tokens[:pos], f"call {i} saw a different context"
        ids = out["output_ids"]
        lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        assert sample.tokens[pos: pos + len(ids)] == ids
        r = pos - prompt_len
        for j in range(len(ids)):
            assert sample.loss_mask[r + j] == (1 if r + j >= trained_from else 0), (i, j)
            assert sample.rollout_log_probs[r + j] == pytest.approx(lps[j], abs=1e-6)
        pos += len(ids)
        nxt = calls[i + 1][0]["input_ids"] if i + 1 < len(calls) else sample.tokens
        gap = nxt[pos:]
        if i + 1 < len(calls):
            text = tok.decode(gap, skip_special_tokens=False)
            assert text.startswith("\n<|im_start|>user\n<tool_response>\n") and text.endswith(
                "</tool_response><|im_end|>\n<|im_start|>assistant\n"), text
            r = pos - prompt_len
            assert sample.loss_mask[r: r + len(gap)] == [0] * len(gap)
            assert sample.rollout_log_probs[r: r + len(gap)] == [0.0] * len(gap)
            pos += len(gap)
        else:
            assert gap == [], "tokens after the last model turn"
    assert pos - prompt_len == resp and len(sample.tokens) == pos


def test_two_turn_episode_token_accounting_matches_template_and_model(engine):
    import torch

    tok = engine.tok
    s, calls = episode(engine, "What is 1234 * 5678?")
    assert s.status == Status.COMPLETED and s.metadata["reason"] == "answered" and s.metadata["turns"] == 2
    assert s.metadata["tool_calls"] == [{"turn": 1, "name": "python", "status": "ok"}]
    assert final_text(s) == ANSWER and len(calls) == 2
    prompt_ids = prompt_sample(tok, "What is 1234 * 5678?").tokens
    # the exact expected token list, built independently of the rollout code
    fmt = ChatTurnFormat(tok)
    turn1 = tok.encode(FIRST_TURNS["What is 1234 * 5678?"], add_special_tokens=False) + [tok.eos_token_id]
    obs = tok.encode(fmt.between_turns(Observation(text="7006652"), "<|im_end|>"), add_special_tokens=False)
    turn2 = tok.encode(ANSWER, add_special_tokens=False) + [tok.eos_token_id]
    assert s.tokens == prompt_ids + turn1 + obs + turn2
    assert s.loss_mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    check_accounting(s, calls, tok, len(prompt_ids))
    # the transcript is the chat template's rendering of the conversation
    convo = [{"role": "user", "content": "What is 1234 * 5678?"},
             {"role": "assistant", "content": FIRST_TURNS["What is 1234 * 5678?"]},
             {"role": "user", "content": "<tool_response>\n7006652\n</tool_response>"},
             {"role": "assistant", "content": ANSWER}]
    assert tok.decode(s.tokens, skip_special_tokens=False) + "\n" == tok.apply_chat_template(convo, tokenize=False)
    assert s.response == tok.decode(s.response_tokens, skip_special_tokens=False)
    # the engine's log-probs belong to the positions they are stored at: recompute them with HF
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([s.tokens])).logits[0, :-1]
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.tokens[1:])[:, None])[:, 0][-s.response_length:]
    for j, (m, lp) in enumerate(zip(s.loss_mask, s.rollout_log_probs)):
        if m:
            assert lp == pytest.approx(ref[j].item(), abs=2e-4), j
    # the example's reward grades the final turn
    sys.path.insert(0, str(EXAMPLE))
    try:
        import tool_math

        assert asyncio.run(tool_math.reward(None, s)) == 1.0
        s.metadata["final_text"] = "the tool said 7006652"
        assert asyncio.run(tool_math.reward(None, s)) == 0.0
    finally:
        sys.path.remove(str(EXAMPLE))


@pytest.mark.parametrize("question, status, needle", [
    ("Loop forever.", "timeout", "Error: the program ran longer than 1 s and was stopped."),
    ("Divide by zero.", "error", "ZeroDivisionError: division by zero"),
    ("Use memory.", "memory", "Error: the program ran out of memory (limit 256 MB)."),
    ("Broken call.", "malformed", "Error: the tool call is not valid JSON"),
    ("Print a lot.", "truncated", "[output truncated: the program printed 6001 bytes; 200 are shown]"),
])
def test_tool_failures_reach_the_model_and_the_episode_goes_on(engine, question, status, needle):
    # 1 s only where the timeout is the point: a loaded 2-core machine can take longer than that to start the
    # sandboxed interpreter of a program that ends at once (seen as "timeout" for "Print a lot.")
    timeout = 1 if status == "timeout" else 30
    factory = make_tool_env_factory([PythonTool(timeout_s=timeout, memory_mb=256, max_output_bytes=200)])
    s, calls = episode(engine, question, factory, max_turns=2)
    assert s.metadata["tool_calls"] == [{"turn": 1, "name": "" if status == "malformed" else "python", "status": status}]
    assert needle in s.response and len(calls) == 2 and s.metadata["turns"] == 2
    assert s.status in (Status.COMPLETED, Status.TRUNCATED) and s.metadata["reason"]
    check_accounting(s, calls, engine.tok, len(prompt_sample(engine.tok, question).tokens))


def test_limits_end_the_sample_truncated_with_a_reason(engine):
    tok = engine.tok
    # 6000 bytes of tool output do not fit the model's 512-token context (read from model.path): not appended
    s, calls = episode(engine, "Print a lot.", make_tool_env_factory([PythonTool(max_output_bytes=6000)]))
    assert (s.status, s.metadata["reason"], len(calls)) == (Status.TRUNCATED, "context_limit", 1)
    assert s.metadata["dropped_observation_tokens"] > 512 - len(s.tokens) and s.loss_mask == [1] * s.response_length
    check_accounting(s, calls, tok, s.prompt_length)
    # a context limit we got wrong: the engine refuses, the sample ends truncated instead of failing the rollout
    s, calls = episode(engine, "What is 1234 * 5678?", params={**GREEDY, "max_new_tokens": 1000}, max_context_len=100_000)
    assert (s.status, s.metadata["reason"], s.response_length, calls) == (Status.TRUNCATED, "context_limit", 0, [])
    assert "context length" in s.metadata["engine_error"]
    # the response budget (max_new_tokens) counts tool tokens too
    turn1 = len(tok.encode(FIRST_TURNS["What is 1234 * 5678?"], add_special_tokens=False)) + 1
    s, calls = episode(engine, "What is 1234 * 5678?", params={**GREEDY, "max_new_tokens": turn1 + 5})
    assert (s.status, s.metadata["reason"], s.response_length) == (Status.TRUNCATED, "response_budget", turn1)
    # a turn cut by the budget
    s, _ = episode(engine, "What is 1234 * 5678?", params={**GREEDY, "max_new_tokens": 10})
    assert (s.status, s.metadata["reason"], s.response_length) == (Status.TRUNCATED, "response_budget", 10)
    s, _ = episode(engine, "What is 1234 * 5678?", max_tokens_per_turn=7)
    assert (s.status, s.metadata["reason"], s.response_length) == (Status.TRUNCATED, "turn_length", 7)
    # max_turns, also from the prompt's metadata; the unanswered tool call gets no observation
    q = "What is 1234 * 5678?"
    s, calls = episode(engine, q, sample=prompt_sample(tok, q, multiturn={"max_turns": 1}))
    assert (s.status, s.metadata["reason"], s.response_length, len(calls)) == (Status.TRUNCATED, "max_turns", turn1, 1)
    with pytest.raises(Exception, match="unknown option"):
        episode(engine, q, sample=prompt_sample(tok, q, multiturn={"max_turn": 1}))


def test_stop_after_tool_call_adds_the_end_of_turn_marker_untrained(engine):
    full, _ = episode(engine, "What is 1234 * 5678?")
    s, calls = episode(engine, "What is 1234 * 5678?", stop_after_tool_call=True)
    assert calls[0][1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "</tool_call>"}
    assert s.tokens == full.tokens and s.status == Status.COMPLETED  # the same transcript...
    eos_at = len(calls[0][1]["output_ids"])
    assert s.response_tokens[eos_at] == engine.tok.eos_token_id
    expect = list(full.loss_mask)
    expect[eos_at] = 0  # ...but the turn's <|im_end|> came from the template, not the model
    assert s.loss_mask == expect and s.rollout_log_probs[eos_at] == 0.0


def test_environment_error_fails_only_that_sample(engine):
    class Broken:
        async def step(self, action_text):
            raise KeyError("state")

    s, calls = episode(engine, "What is 1234 * 5678?", lambda args, sample: Broken())
    assert s.status == Status.FAILED and s.remove_sample and s.metadata["reason"] == "env_error: KeyError: 'state'"
    check_accounting(s, calls, engine.tok, s.prompt_length)


@pytest.mark.parametrize("mask_offpolicy", [False, True])
def test_aborted_turn_continues_to_the_same_tokens(engine, mask_offpolicy):
    """Partial rollout: a sample aborted mid-turn continues that turn; the result equals an uninterrupted run."""
    from slimectl.engines.pool import EnginePool

    tok = engine.tok
    full, _ = episode(engine, "What is 1234 * 5678?")
    part = prompt_sample(tok, "What is 1234 * 5678?")

    async def first_ten():
        pool = EnginePool([engine.url])
        try:
            out = await pool.generate(input_ids=part.tokens, sampling_params={**GREEDY, "max_new_tokens": 10},
                                      return_logprob=True)
        finally:
            await pool.close()
        part.append_response_tokens(out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]], True,
                                    out["meta_info"])
        part.status = Status.ABORTED

    asyncio.run(first_ten())
    s, calls = episode(engine, "", sample=part, mask_offpolicy=mask_offpolicy)
    assert s.tokens == full.tokens and s.status == Status.COMPLETED and s.metadata["turns"] == 2
    assert s.rollout_log_probs == pytest.approx(full.rollout_log_probs, abs=1e-5)
    expect = list(full.loss_mask)
    if mask_offpolicy:
        expect[:10] = [0] * 10
    assert s.loss_mask == expect


def test_multiturn_samples_survive_the_parquet_round_trip(engine, tmp_path):
    class Broken:
        async def step(self, action_text):
            raise RuntimeError("bug")

    factory = make_tool_env_factory([PythonTool(timeout_s=1, memory_mb=256)])
    samples = [episode(engine, "What is 1234 * 5678?")[0], episode(engine, "Divide by zero.", factory, max_turns=2)[0],
               episode(engine, "What is 1234 * 5678?", max_turns=1)[0],
               episode(engine, "What is 1234 * 5678?", lambda args, sample: Broken())[0]]
    assert [samples[i].status for i in (0, 2, 3)] == [Status.COMPLETED, Status.TRUNCATED, Status.FAILED]
    write_samples(samples, tmp_path / "s.parquet")
    back = read_samples(tmp_path / "s.parquet")
    assert len(back) == len(samples)
    for a, b in zip(samples, back):
        da, db = a.to_dict(), b.to_dict()
        assert db.pop("rollout_log_probs") == pytest.approx(da.pop("rollout_log_probs"), abs=1e-6)  # float32 on disk
        assert db == da


def test_rollout_cli_with_the_example_config_keys(engine, tmp_path, cli, monkeypatch):
    """``slimectl rollout`` with rollout.custom_generate = the multi-turn generate and the example's reward."""
    from slimectl.contract.config import load_config
    from slimectl.contract.rundir import EngineRecord, RunDir

    cfg = load_config(EXAMPLE / "config.yaml")  # the example's keys are all known
    assert cfg.rollout.custom_generate == "slimectl.agents.multiturn:generate" and cfg.rollout.reward == "tool_math:reward"
    monkeypatch.syspath_prepend(str(EXAMPLE))
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"input": "What is 1234 * 5678?", "label": "7006652"}) + "\n")
    res = cli("init", tmp_path / "run", "--set", f"model.path={engine.model_dir}", "--set", f"data.prompt_data={data}",
              "--set", f"rollout.custom_generate={cfg.rollout.custom_generate}", "--set", f"rollout.reward={cfg.rollout.reward}",
              "--set", "rollout.batch_size=1", "--set", "rollout.n_samples_per_prompt=2",
              "--set", "rollout.max_response_len=200", "--set", "rollout.temperature=0.01")
    assert res.exit_code == 0, res.output
    run_dir = RunDir.open(tmp_path / "run")
    run_dir.engines.register(EngineRecord(url=engine.url, backend="embedded", pid=os.getpid(), id="e0", weight_version="0"))
    res = cli("rollout", "-r", run_dir.path)
    assert res.exit_code == 0, res.output
    from slimectl.contract.samples import SAMPLES_FILE

    samples = read_samples(run_dir.rollouts.get(0).file(SAMPLES_FILE))
    assert len(samples) == 2
    for s in samples:
        assert s.status == Status.COMPLETED and s.reward == 1.0 and s.metadata["turns"] == 2
        assert s.metadata["tool_calls"] == [{"turn": 1, "name": "python", "status": "ok"}]
        assert 0 in s.loss_mask and s.loss_mask[0] == 1 and s.loss_mask[-1] == 1
        assert len(s.weight_versions) == 2  # one per engine call
    # eval runs the same generate function as the rollouts (multi-turn here, with the tool)
    from slimectl.contract.config import apply_overrides, build_config
    from slimectl.stages.rollout.eval import run_eval

    ecfg = build_config(apply_overrides(run_dir.config().model_dump(mode="json"), [f"data.eval_data={{\"q\": \"{data}\"}}", "rollout.eval_n_samples=1",
                                              "rollout.eval_temperature=0.01", "rollout.eval_max_response_len=200"]))
    flat = run_eval(run_dir, ecfg, 0, [engine.url])
    assert flat["eval/q/pass@1"] == 1.0
    (evaluated,) = read_samples(run_dir.evals.get(0).file("q.parquet"))
    assert evaluated.metadata["turns"] == 2 and evaluated.metadata["tool_calls"][0]["name"] == "python"
