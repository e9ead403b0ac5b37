"""``slimectl rollout import FILE``: publish samples made outside slimectl as ``rollouts/N``.

FILE is JSON Lines (one Sample per line, the field names of :class:`slimectl.samples.Sample`)
or a samples Parquet file. Every sample is validated before anything is written — token ids
within the model's vocabulary, ``response_length`` inside ``tokens``, per-token lists as long
as the response, a numeric reward, a group — and the first problem is reported with its line.
The rollout is published with the run-dir protocol like a generated one, so ``train`` consumes
it exactly once.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from slimectl.config import SlimectlConfig
from slimectl.errors import ArtifactExists, SlimectlError, UsageError
from slimectl.rundir import RunDir
from slimectl.samples import SAMPLES_FILE, Sample, Status, read_samples, write_samples

DATA_STATE = "data_state.json"


@dataclass
class ImportResult:
    rollout_id: int
    num_samples: int
    path: Path


def _load(path: Path) -> list[tuple[str, Sample]]:
    """(where, sample) pairs; ``where`` is ``FILE:LINE`` for JSON Lines."""
    if not path.is_file():
        raise UsageError(f"{path}: no such file; pass a .jsonl or .parquet file of samples")
    if path.suffix == ".parquet":
        return [(f"{path}: sample {i}", s) for i, s in enumerate(read_samples(path))]
    if path.suffix not in (".jsonl", ".json"):
        raise UsageError(f"{path}: expected a .jsonl (one sample per line) or .parquet file")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                d = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SlimectlError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(d, dict):
                raise SlimectlError(f"{where}: expected a JSON object with Sample fields")
            try:
                out.append((where, Sample.from_dict(d)))
            except (ValueError, TypeError) as exc:
                raise SlimectlError(f"{where}: {exc}") from None
    if not out:
        raise SlimectlError(f"{path} holds no samples")
    return out


def _check(where: str, s: Sample, vocab_size: int | None, reward_key: str | None) -> None:
    def bad(msg: str) -> SlimectlError:
        return SlimectlError(f"{where}: {msg}")

    if not isinstance(s.tokens, list) or not s.tokens or not all(isinstance(t, int) and t >= 0 for t in s.tokens):
        raise bad("tokens must be a non-empty list of non-negative token ids")
    if vocab_size is not None and max(s.tokens) >= vocab_size:
        raise bad(f"token id {max(s.tokens)} is outside the model's vocabulary ({vocab_size} ids)")
    if s.response_length <= 0:
        raise bad("response_length must be > 0 (the tokens to train on are the last response_length)")
    try:
        s.validate()
    except ValueError as exc:
        raise bad(str(exc)) from None
    if s.group_index is None:
        raise bad("group_index is missing (samples of one prompt share a group_index)")
    try:
        value = s.reward_value(reward_key)
    except (SlimectlError, KeyError, TypeError, ValueError) as exc:
        raise bad(f"no usable reward ({exc})") from None
    if value != value:  # NaN
        raise bad("reward is NaN")
    if s.rollout_log_probs is not None and any(x > 1e-6 for x in s.rollout_log_probs):
        raise bad("rollout_log_probs must be <= 0 (they are log-probabilities)")


def import_rollout(run: RunDir, cfg: SlimectlConfig, path: str | Path, rollout_id: int | None = None,
                   force: bool = False) -> ImportResult:
    from slimectl.models.arch import arch_from_dir

    path = Path(path)
    pairs = _load(path)
    vocab = None
    if cfg.model.path and (Path(cfg.model.path) / "config.json").is_file():
        vocab = arch_from_dir(cfg.model.path).vocab_size
    for where, s in pairs:
        _check(where, s, vocab, cfg.rollout.reward_key)
    samples = [s for _, s in pairs]
    with run.lock("rollout"):
        ids = run.rollouts.ids()
        rid = (ids[-1] + 1 if ids else 0) if rollout_id is None else rollout_id
        if run.rollouts.exists(rid) and not force:
            raise ArtifactExists(f"rollouts/{rid:06d} is already published; pass --force to replace it")
        for i, s in enumerate(samples):
            s.rollout_id = rid
            if s.index is None:
                s.index = i
            if s.status == Status.PENDING:
                s.status = Status.COMPLETED
        versions = {v for s in samples for v in s.weight_versions}
        rewards = [s.reward_value(cfg.rollout.reward_key) for s in samples]
        meta = {"rollout_id": rid, "source": "import", "imported_from": str(path.resolve()),
                "weight_version": max(versions) if len(versions) == 1 else None,
                "num_samples": len(samples), "num_groups": len({s.group_index for s in samples}),
                "reward_mean": statistics.fmean(rewards)}
        # Generated rollouts after this one continue the prompt data where the previous one stopped.
        state = run.rollouts.get(rid - 1).file(DATA_STATE).read_text() if rid > 0 and run.rollouts.exists(rid - 1) \
            and DATA_STATE in run.rollouts.get(rid - 1).files else "null"
        with run.rollouts.publish(rid, meta=meta, stage="rollout-import", overwrite=force) as staging:
            write_samples(samples, staging / SAMPLES_FILE)
            (staging / DATA_STATE).write_text(state)
            (staging / "metrics.json").write_text(json.dumps({"rollout/reward_mean": meta["reward_mean"],
                                                              "rollout/num_samples": len(samples)}, indent=2))
        return ImportResult(rid, len(samples), run.rollouts.dir_for(rid))
