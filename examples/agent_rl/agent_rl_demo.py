r"""The agent demo: an unchanged OpenAI-client agent (agent.py) trained by ``slimectl rl`` through the harness.

    python examples/agent_rl/agent_rl_demo.py [RUN_DIR] [--sft-steps N] [--set KEY=VALUE ...]   (default: runs/agent-rl)
    python examples/agent_rl/agent_rl_demo.py --write-data      # (re)write data.jsonl only

1. ``slimectl init RUN-warmstart``  the tiny offline Qwen2 (sft_warmstart.yaml), its chat template replaced by
   chat_template.jinja (a Qwen2.5-style one that knows tools and ``tool`` messages, tool list shortened)
2. SFT samples: the agent's episode as the harness records it (the calculator call, the tool's answer with loss
   mask 0, ``\boxed{product}``), published as the warm start's rollouts; ``slimectl train -r RUN-warmstart``
3. ``PYTHONPATH=examples/agent_rl slimectl rl --config config.yaml -r RUN``: each sample is one run of
   ``agent:run`` against the rollout's harness; GRPO on the agent's reward
4. ``slimectl plot -r RUN``: the reward curve

Rerunning resumes every step from its run directory. The tasks are products of two 1-digit numbers. The warm start's
demonstrator is sloppy on purpose (:data:`SLOPPY`): half its calls miscopy an operand and half its answers miscopy
the calculator's result, so the warm-started model calls the tool in the right format but is often wrong, and the
agent's graded reward (1 right; partial credit for a working call, the right operands, the result copied) spreads
within a group.
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
miscopies the calculator's result into its answer. It is meant to leave a warm start that calls the tool in the
right format but is right only about a quarter of the time, which leaves `rl` something to learn (on the tiny
model it learned neither copy; docs/agent-harness.md)."""


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


def publish_sft_rollouts(run_path: str, seed: int) -> None:
    from transformers import AutoTokenizer

    from slimectl.contract.rundir import RunDir
    from slimectl.contract.samples import SAMPLES_FILE, Sample, Status, write_samples

    run = RunDir.open(run_path)
    cfg = run.config()
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    rows, rng = make_rows(), random.Random(seed)
    for rid in range(cfg.rollout.num_rollout):
        if run.rollouts.exists(rid):
            continue
        samples = []
        for i in range(cfg.rollout.batch_size):
            row = rng.choice(rows)
            prompt, pieces = episode(tok, row, rng)
            s = Sample(group_index=i, index=i, rollout_id=rid, prompt=row["input"], tokens=list(prompt),
                       label=row["label"])
            for ids, trained in pieces:
                s.append_response_tokens(ids, [0.0] * len(ids) if trained else None, trained,
                                         {"weight_version": "sft"} if trained else None)
            s.status, s.reward = Status.COMPLETED, 0.0
            samples.append(s)
        with run.rollouts.publish(rid, meta={"weight_version": "0", "kind": "sft"}, stage="sft-data") as d:
            write_samples(samples, d / SAMPLES_FILE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", default="runs/agent-rl")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sft-steps", type=int, default=None, help="default: sft_warmstart.yaml's")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a key of config.yaml for the rl run, e.g. rollout.num_rollout=60")
    ap.add_argument("--write-data", action="store_true", help="write data.jsonl and exit")
    a = ap.parse_args()
    data = write_data()
    if a.write_data:
        print(data)
        return
    warm = f"{a.run}-warmstart"
    sft = [] if a.sft_steps is None else ["--set", f"rollout.num_rollout={a.sft_steps}",
                                          "--set", f"train.save_interval={a.sft_steps}"]
    from slimectl.contract.rundir import RunDir

    if not Path(warm, "run.json").exists():
        slimectl("init", warm, "--config", str(HERE / "sft_warmstart.yaml"), "--tiny-model", "qwen2",
                 "--set", f"train.seed={1234 + a.seed}", *sft)
        template = Path(RunDir.open(warm).config().model.path) / "chat_template.jinja"
        template.write_text((HERE / "chat_template.jinja").read_text())
    publish_sft_rollouts(warm, a.seed)
    slimectl("train", "-r", warm, "--allow-empty")
    start = str(RunDir.open(warm).weights.latest().path)
    slimectl("rl", "--config", str(HERE / "config.yaml"), "-r", a.run, "--set", f"model.path={start}",
             "--set", f"rollout.seed={42 + a.seed}", "--set", f"data.seed={42 + a.seed}",
             "--set", f"train.seed={1234 + a.seed}", *(x for o in a.overrides for x in ("--set", o)))
    slimectl("plot", "-r", a.run)


if __name__ == "__main__":
    main()
