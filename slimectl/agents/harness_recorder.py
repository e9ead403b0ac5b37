"""The agent harness's trajectory recorder: each request's prompt and reply into a session's token-exact segments.

The token list is the source of truth (see :mod:`slimectl.agents.harness`): when a request's rendered
prompt extends a segment's text, only the new text is tokenized and appended (loss mask 0, log-prob 0)
after the model's own tokens (loss mask 1, engine log-probs); otherwise a new segment starts, with the
reason recorded.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

from slimectl.agents.harness_parsers import ParsedReply
from slimectl.agents.harness_sessions import Reply, Segment, Session
from slimectl.contract.samples import Sample


@dataclass
class Prompt:
    """What one request sends the engine, and which segment it continues."""

    text: str
    """The rendered prompt."""
    input_ids: list[int]
    segment: Segment | None
    """The segment it continues; None: it starts a new one."""
    cut: int = 0
    """Generated tokens of that segment to drop first (its last reply's stop sequence, left out of the history)."""
    observed: list[int] | None = None
    """The tokens of the text after the segment's (appended with loss mask 0)."""


@dataclass
class Turn:
    """One generated turn of ``session``, not yet recorded: the engine's answer ``out`` to ``prompt``, its
    ``reply`` (content and stop tail), the agent's view of it (``parsed``) and the API's finish reason."""

    session: Session
    prompt: Prompt
    out: dict[str, Any]
    reply: Reply
    parsed: ParsedReply
    finish: str


class TrajectoryRecorder:
    """Turns a session's requests and the engine's replies into token-exact segments, with ``tokenizer``
    (the engines'). Not thread-safe: the harness calls :meth:`prompt` from its one tokenizer thread."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        # Special tokens are kept so the text round-trips through the chat template exactly.
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def prompt(self, sess: Session, text: str) -> Prompt:
        """The token ids for the rendered prompt ``text``: a continued segment's tokens and the new text's, or
        the whole text tokenized."""
        seg, cut, matched = continuation(sess, text)
        if seg is None:
            return Prompt(text, self.encode(text), None)
        kept = seg.sample.tokens[: len(seg.sample.tokens) - cut]
        observed = self.encode(text[matched:])
        return Prompt(text, kept + observed, seg, cut, observed)

    @staticmethod
    def fork(sess: Session, prompt: Prompt, choice: int) -> Prompt:
        """``prompt`` for another choice of an ``n > 1`` request: a copy of the segment it continues (its earlier
        model tokens with loss mask 0: the segment it was copied from trains them), added to the session."""
        seg = prompt.segment
        if seg is None:
            return prompt  # each choice starts a segment of its own
        twin = copy.deepcopy(seg)
        twin.sample.loss_mask = [0] * len(twin.sample.loss_mask or [])
        twin.start = {**seg.start, "forked_from_segment": sess.segments.index(seg), "choice": choice,
                      "turn": len(seg.turns) + 1}
        sess.segments.append(twin)
        return Prompt(prompt.text, prompt.input_ids, twin, prompt.cut, prompt.observed)

    @staticmethod
    def place(sess: Session, prompt: Prompt) -> tuple[int, int]:
        """Where :meth:`record` will put the reply to ``prompt``: (its segment's number, its turn's number)."""
        if prompt.segment is None:
            return len(sess.segments), 1
        return sess.segments.index(prompt.segment), len(prompt.segment.turns) + 1

    def record(self, sess: Session, prompt: Prompt, messages: list[dict[str, Any]],
               out: dict[str, Any], message: dict[str, Any] | None = None) -> tuple[Reply, int, int]:
        """Record the engine's answer ``out`` (SGLang's /generate) to ``prompt``: (the reply, its segment's number,
        its turn's number). ``message``: the assistant message the agent was answered (default: the content)."""
        meta = out["meta_info"]
        reply = self.split(out["output_ids"], meta.get("finish_reason") or {})
        seg, text = prompt.segment, prompt.text
        if seg is None:
            seg = Segment(Sample(prompt=messages, tokens=list(prompt.input_ids)), text, start_reason(sess, text))
            sess.segments.append(seg)
        else:
            if prompt.cut:
                seg.drop_tail()
            seg.sample.append_response_tokens(prompt.observed, None, False)
            seg.text = text
        lps = [float(x[0]) for x in meta.get("output_token_logprobs", [])]
        status_meta = {"weight_version": meta.get("weight_version"), "weight_versions": meta.get("weight_versions"),
                       "finish_reason": {"type": reply.finish_reason}}
        seg.sample.append_response_tokens(out["output_ids"], lps, True, status_meta)
        seg.tail_tokens = reply.tail_tokens
        seg.tail_start = len(seg.text) + reply.tail_start
        seg.text += reply.full_text
        seg.messages = messages + [message or {"role": "assistant", "content": reply.content}]
        seg.turns.append({"prompt_tokens": len(prompt.input_ids), "completion_tokens": len(out["output_ids"]),
                          "finish_reason": reply.finish_reason, "engine_url": meta.get("engine_url"),
                          "weight_version": meta.get("weight_version"), "trimmed_tokens": 0})
        sess.last = seg
        return reply, sess.segments.index(seg), len(seg.turns)

    def split(self, out_ids: list[int], finish: dict[str, Any]) -> Reply:
        """Separate the reply's content (what the agent sees) from its stop sequence."""
        kind, matched = finish.get("type"), finish.get("matched")
        eos = self.tokenizer.eos_token_id
        stop_token = (kind == "stop" and isinstance(matched, int)) or (bool(out_ids) and out_ids[-1] == eos)
        if stop_token and out_ids:
            content = self.decode(out_ids[:-1])
            return Reply(content, "stop", content + self.decode(out_ids[-1:]), 1, len(content))
        full = self.decode(out_ids)
        if kind == "stop" and isinstance(matched, str):
            pos = full.find(matched)
            content = full[:pos] if pos >= 0 else full
            # The shortest tail whose removal leaves exactly the content (a stop string that
            # starts inside a token cannot be cut off; the next turn then starts a new segment).
            window = range(len(out_ids) - 1, max(-1, len(out_ids) - 4 * len(matched) - 9), -1)
            keep = next((k for k in window if self.decode(out_ids[:k]) == content), None)
            if keep is not None:
                return Reply(content, "stop", full, len(out_ids) - keep, len(content))
            return Reply(content, "stop", full, 0, 0)
        return Reply(full, "length" if kind == "length" else "stop", full, 0, 0)


def continuation(sess: Session, text: str) -> tuple[Segment | None, int, int]:
    """The segment a request continues: (segment, generated tokens to drop, chars matched).

    A request continues a segment when its rendered prompt starts with everything the
    segment's tokens stand for — or with all of it but the last reply's stop sequence,
    which the agent's history leaves out (stop strings, a stop token the template does
    not write back); those tokens are then dropped. The most recent segment is tried first.
    """
    order = ([sess.last] if sess.last else []) + [s for s in reversed(sess.segments) if s is not sess.last]
    for seg in order:
        if text.startswith(seg.text):
            return seg, 0, len(seg.text)
        if seg.tail_tokens and text.startswith(seg.text[: seg.tail_start]):
            return seg, seg.tail_tokens, seg.tail_start
    return None, 0, 0


def start_reason(sess: Session, text: str) -> dict[str, Any]:
    """Why a request starts a new segment of ``sess``."""
    if sess.last is None:
        return {"reason": "first request of the session"}
    prev = sess.last.text
    at = len(os.path.commonprefix([prev, text]))
    return {"reason": "the request's history does not extend any earlier turn of the session "
                      "(edited or different history)",
            "after_segment": sess.segments.index(sess.last), "diverges_at_char": at,
            "recorded": prev[at:at + 80], "requested": text[at:at + 80]}
