r"""The agent demo: an unchanged OpenAI-client agent (agent.py) trained by ``slimectl rl`` through the harness.

    python examples/agent_rl/agent_rl_demo.py [RUN_DIR] [--sft-steps N] [--set KEY=VALUE ...]   (default: runs/agent-rl)
    python examples/agent_rl/agent_rl_demo.py --write-data      # (re)write data.jsonl only

1. the warm start (``RUN-warmstart``, a Hugging Face folder): the tiny offline Qwen2, its chat template replaced by
   chat_template.jinja (a Qwen2.5-style one that knows tools and ``tool`` messages, tool list shortened), after
   :data:`SFT_STEPS` steps of SFT in plain PyTorch on the agent's episodes as the harness records them (the
   calculator call, the tool's answer untrained, ``\boxed{product}``)
2. ``PYTHONPATH=examples/agent_rl slimectl rl --config config.yaml -r RUN``: each sample is one run of
   ``agent:run`` against the rollout's harness; GRPO on the agent's reward
3. ``slimectl plot -r RUN``: the reward curve

Rerunning resumes: a finished warm start is kept, ``rl`` resumes from its run directory. The tasks are products of two
1-digit numbers. The warm start's demonstrator is right in its first :data:`CLEAN_STEPS` batches (the tiny model
needs about 200 to learn to copy the operands into the call and the result into its answer), then sloppy on purpose
(:data:`SLOPPY`): half its calls miscopy an operand and half its answers miscopy the calculator's result. The
warm-started model calls the tool in the right format and can copy, but often does not, and the agent's graded
reward (1 right; partial credit for a working call, the right operands, the result copied) spreads within a group.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import agent  # noqa: E402  (examples/agent_rl/agent.py: TOOLS and the calculator)


def make_rows(n: int = 256, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        rows.append({"input": [{"role": "user", "content": f"What is {a} * {b}? Use the calculator."}],
                     "label": str(a * b)})
    return rows


def write_data() -> Path:
    out = HERE / "data.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in make_rows()), encoding="utf-8")
    return out


def slimectl(*args: str) -> None:
    print(f"$ slimectl {' '.join(args)}", file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    rc = subprocess.run([sys.executable, "-m", "slimectl", *args], env=env).returncode
    if rc:
        sys.exit(f"slimectl {args[0]} failed with exit code {rc}")


SLOPPY = 0.5
"""How often the warm start's demonstrator miscopies an operand into the call, and (independently) how often it
miscopies the calculator's result into its answer, after its first :data:`CLEAN_STEPS` batches. It leaves a warm
start that calls the tool in the right format and can copy, but often does not, which leaves `rl` something to
learn."""
CLEAN_STEPS = 260
"""The warm start's first batches are clean (the demonstrator always right): the tiny model learns to copy the
operands into the call and the result into its answer only after about 200 such steps (docs/agent-harness.md).
The batches after them are sloppy."""
SFT_STEPS = 320
"""The warm start's steps: :data:`CLEAN_STEPS` clean, the rest sloppy."""


def episode(tok, row: dict, rng: random.Random | None = None) -> tuple[list[int], list[tuple[list[int], bool]]]:
    """The prompt tokens and the response pieces (tokens, trained) of one episode, as the harness renders and
    records it. With ``rng`` the demonstrator is sloppy (:data:`SLOPPY`); without, it is always right."""
    messages = row["input"]
    expression = messages[0]["content"].split("What is ")[1].split("?")[0]
    if rng is not None and rng.random() < SLOPPY:  # one operand miscopied
        ops = expression.split(" * ")
        i = rng.randrange(2)
        ops[i] = rng.choice([d for d in "23456789" if d != ops[i]])
        expression = " * ".join(ops)
    call = {"id": "call_0", "type": "function",  # the arguments as an object, as the harness renders them
            "function": {"name": "calculator", "arguments": {"expression": expression}}}
    render = lambda msgs: tok.apply_chat_template(msgs, tools=agent.TOOLS, add_generation_prompt=True, tokenize=False)
    first = render(messages)
    call_text = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
    result = agent.calculator(json.dumps(call["function"]["arguments"]))
    second = render(messages + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                {"role": "tool", "tool_call_id": "call_0", "content": result}])
    observation = second[len(first) + len(call_text) + len(tok.eos_token):]
    answer = result
    if rng is not None and rng.random() < SLOPPY:  # the result miscopied
        answer = str(rng.choice([n for n in range(4, 82) if str(n) != result]))
    enc = lambda text: tok.encode(text, add_special_tokens=False)
    return enc(first), [(enc(call_text) + [tok.eos_token_id], True), (enc(observation), False),
                        (enc(f"\\boxed{{{answer}}}") + [tok.eos_token_id], True)]


def sft_batch(tok, rows: list[dict], step: int, seed: int, size: int = 32) -> tuple:
    """Batch ``step`` of the warm start: (input ids, labels), -100 on the prompt and the tool's answer, padded.
    Clean before :data:`CLEAN_STEPS`, sloppy after."""
    import torch

    rng = random.Random(f"{seed}-{step}")  # a batch does not depend on the batches before it
    seqs = []
    for _ in range(size):
        prompt, pieces = episode(tok, rng.choice(rows), rng if step >= CLEAN_STEPS else None)
        ids, labels = list(prompt), [-100] * len(prompt)
        for piece, trained in pieces:
            ids, labels = ids + piece, labels + (piece if trained else [-100] * len(piece))
        seqs.append((ids, labels))
    width = max(len(ids) for ids, _ in seqs)
    x = torch.tensor([ids + [tok.pad_token_id] * (width - len(ids)) for ids, _ in seqs])
    y = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in seqs])
    return x, y


def warm_start(out: Path, steps: int, seed: int) -> Path:
    """The tiny offline Qwen2 (chat template: chat_template.jinja) after ``steps`` steps of SFT (AdamW, lr 3e-3, 32
    episodes a step) on the agent's episodes, saved as a Hugging Face folder at ``out``; kept if already there."""
    if (out / "model.safetensors").exists():
        return out
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slimectl.starter_models.tiny_models import build_tiny_model

    part = out.with_name(out.name + ".part")  # built aside, renamed into place: a killed run leaves no half model
    shutil.rmtree(part, ignore_errors=True)
    build_tiny_model("qwen2", part, seed=seed)
    (part / "chat_template.jinja").write_text((HERE / "chat_template.jinja").read_text())
    tok, rows = AutoTokenizer.from_pretrained(part), make_rows()
    torch.manual_seed(1234 + seed)
    torch.set_num_threads(1)  # a 0.1M-parameter model gains nothing from a second thread, and a shared core stalls it
    model = AutoModelForCausalLM.from_pretrained(part, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(steps):
        x, y = sft_batch(tok, rows, step, seed)
        loss = model(input_ids=x, labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step % 20 == 0 or step == steps - 1:
            print(f"warm start step {step + 1}/{steps}: loss {loss.item():.3f}", file=sys.stderr, flush=True)
    model.save_pretrained(part)
    tok.save_pretrained(part)
    (part / "chat_template.jinja").write_text((HERE / "chat_template.jinja").read_text())
    part.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", default="runs/agent-rl")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sft-steps", type=int, default=SFT_STEPS, help=f"warm start steps (default {SFT_STEPS})")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a key of config.yaml for the rl run, e.g. rollout.num_rollout=60")
    ap.add_argument("--write-data", action="store_true", help="write data.jsonl and exit")
    a = ap.parse_args()
    data = write_data()
    if a.write_data:
        print(data)
        return
    start = warm_start(Path(f"{a.run}-warmstart").resolve(), a.sft_steps, a.seed)
    slimectl("rl", "--config", str(HERE / "config.yaml"), "-r", a.run, "--set", f"model.path={start}",
             "--set", f"rollout.seed={42 + a.seed}", "--set", f"data.seed={42 + a.seed}",
             "--set", f"train.seed={1234 + a.seed}", *(x for o in a.overrides for x in ("--set", o)))
    slimectl("plot", "-r", a.run)


if __name__ == "__main__":
    main()
