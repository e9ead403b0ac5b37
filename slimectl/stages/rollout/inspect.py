"""Readable views of rollout artifacts (``slimectl inspect rollout``)."""

from __future__ import annotations

import json
from typing import Any

from slimectl.contract.rundir import Artifact, RunDir
from slimectl.contract.samples import SAMPLES_FILE, Sample, read_samples


def load_rollout_samples(run: RunDir, rollout_id: int) -> tuple[Artifact, list[Sample]]:
    art = run.rollouts.get(rollout_id, verify="full")
    return art, read_samples(art.file(SAMPLES_FILE))


def _short(text: str, n: int = 160) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= n else text[: n - 3] + "..."


def format_samples(art: Artifact, samples: list[Sample], limit: int = 8, as_json: bool = False) -> str:
    shown = samples if limit == 0 else samples[:limit]
    if as_json:
        return "\n".join(json.dumps(s.to_dict(), ensure_ascii=False) for s in shown)
    m: dict[str, Any] = art.meta
    lines = [f"rollouts/{art.id:06d}: {len(samples)} samples in {m.get('num_groups')} groups, weight version "
             f"{m.get('weight_version')}, reward mean {m.get('reward_mean', float('nan')):.3f}"]
    for s in shown:
        lp = s.rollout_log_probs or []
        lp_txt = f"logprob mean {sum(lp) / len(lp):.3f} min {min(lp):.3f}" if lp else "no logprobs"
        lines.append(f"--- sample {s.index} (group {s.group_index}) status {s.status.value} reward {s.reward} "
                     f"label {s.label!r}")
        lines.append(f"  prompt:   {_short(s.prompt if isinstance(s.prompt, str) else json.dumps(s.prompt))}")
        lines.append(f"  response: {_short(s.response)}")
        lines.append(f"  tokens:   {s.prompt_length} prompt + {s.response_length} response; {lp_txt}")
        if s.image_hashes:
            lines.append(f"  images:   {', '.join(f'media/{h}.png' for h in s.image_hashes)}")
    if len(shown) < len(samples):
        lines.append(f"... {len(samples) - len(shown)} more (--limit 0 shows all)")
    return "\n".join(lines)
