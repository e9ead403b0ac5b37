"""The agent harness's recordings: sessions of token-exact segments, turned into Samples and exported as JSON Lines.

Why token lists and not text: re-tokenizing the assistant's text on the next turn can give
other ids than the model sampled, so each segment's token list is the source of truth (see
:mod:`slimectl.agents.harness`); every segment becomes its own Sample.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slimectl.contract.errors import UsageError
from slimectl.contract.rundir.atomic import atomic_write_text
from slimectl.contract.samples import Sample


@dataclass
class Segment:
    """One token-exact trajectory: a first prompt, then model turns and the text between them."""

    sample: Sample
    """tokens / loss_mask / rollout_log_probs so far; the response is everything after the first prompt."""
    text: str
    """The text ``sample.tokens`` stand for; the next request must start with it to continue here."""
    start: dict[str, Any]
    """Why this segment started (the first request, or how the history diverged)."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    tail_tokens: int = 0
    """Generated tokens after the reply's content (a matched stop string or stop token)..."""
    tail_start: int = 0
    """...and where they begin in ``text``: dropped if the next request continues without them."""

    def drop_tail(self) -> None:
        """Forget the last reply's stop sequence: the agent's history goes on without it.

        The kept tokens are a prefix of what the model generated, so their log-probs stay valid.
        """
        n = self.tail_tokens
        self.sample.drop_response_tail(n)
        self.text = self.text[: self.tail_start]
        self.turns[-1]["trimmed_tokens"] = n
        self.tail_tokens = 0


@dataclass
class Session:
    id: str
    segments: list[Segment] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last: Segment | None = None
    finished: bool = False
    reward: float | dict[str, Any] | None = None
    label: str | None = None
    group: str | int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    published: bool = False


@dataclass
class Reply:
    """One generation, split into what the agent sees and what the trajectory keeps."""

    content: str
    finish_reason: str  # OpenAI's: "stop" | "length"
    full_text: str  # the text of every generated token
    tail_tokens: int  # generated tokens after ``content`` (stop token / stop string)
    tail_start: int  # len(content) when the tail can be dropped cleanly


def samples_from_sessions(sessions: list[Session], tokenizer, first_index: int = 0,
                          groups: dict[Any, int] | None = None) -> list[Sample]:
    """One Sample per segment of each finished session, numbered for ``rollout import``.

    Sessions finished with the same ``group`` share a ``group_index`` (GRPO-style groups of
    attempts at one task); every other session is a group of its own. ``groups`` (group key ->
    index) carries the numbering across calls.
    """
    groups = {} if groups is None else groups
    out = []
    for sess in sessions:
        key = ("group", sess.group) if sess.group is not None else ("session", sess.id)
        gi = groups.setdefault(key, len(groups))
        for k, seg in enumerate(sess.segments):
            src = seg.sample
            s = Sample(group_index=gi, index=first_index + len(out), prompt=src.prompt, tokens=list(src.tokens),
                       response_length=src.response_length, label=sess.label, reward=sess.reward,
                       loss_mask=list(src.loss_mask or []), rollout_log_probs=list(src.rollout_log_probs or []),
                       weight_versions=list(src.weight_versions),
                       weight_version_spans=[dict(sp) for sp in src.weight_version_spans], status=src.status,
                       multimodal_inputs=({k: list(v) for k, v in src.multimodal_inputs.items()}
                                          if src.multimodal_inputs is not None else None))
            s.response = tokenizer.decode(s.response_tokens, skip_special_tokens=False,
                                          clean_up_tokenization_spaces=False)
            s.metadata = {**sess.metadata, "session_id": sess.id, "segment": k, "num_segments": len(sess.segments),
                          "segment_start": seg.start, "turns": seg.turns, "messages": seg.messages,
                          "group": sess.group}
            out.append(s)
    return out


def export_jsonl(samples: list[Sample], path: str | Path) -> Path:
    """Write samples as JSON Lines (the format ``slimectl rollout import FILE`` reads), atomically."""
    path = Path(path)
    if path.suffix != ".jsonl":
        raise UsageError(f"{path}: the export file must end in .jsonl (`slimectl rollout import` reads it)")
    if not path.parent.is_dir():
        raise UsageError(f"{path.parent}: no such directory; create it or choose another --out")
    for s in samples:
        s.validate()
    atomic_write_text(path, "".join(json.dumps(s.to_dict(), ensure_ascii=False) + "\n" for s in samples))
    return path
