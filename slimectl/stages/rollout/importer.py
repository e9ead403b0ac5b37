"""``slimectl rollout import FILE``: publish samples made outside slimectl as ``rollouts/N``.

FILE is JSON Lines (one Sample per line, the field names of :class:`slimectl.contract.samples.Sample`)
or a samples Parquet file. Every sample is validated before anything is written — token ids
within the model's vocabulary, ``response_length`` inside ``tokens``, per-token lists as long
as the response, a numeric reward, a group (:mod:`slimectl.contract.sample_checks`); a VLM sample's images
(``multimodal_inputs``) each intact in ``RUN/media``, as many as its prompt holds, and no vision token trained on —
and the first problem is reported with its line. The rollout is published with the run-dir protocol like a
generated one, so ``train`` consumes it exactly once.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import ArtifactExists, SlimectlError, UsageError
from slimectl.contract.rundir import RunDir
from slimectl.contract.sample_checks import ImageCheck, check_sample, parse_sample
from slimectl.contract.samples import SAMPLES_FILE, Sample, Status, read_samples, write_samples

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
            out.append((where, parse_sample(where, d)))
    if not out:
        raise SlimectlError(f"{path} holds no samples")
    return out


def model_vocab_size(cfg: SlimectlConfig, allow_vlm: bool = False) -> int | None:
    """The vocabulary size of ``model.path`` when it holds an HF config (token ids are checked against it); a VLM is
    refused in one line unless ``allow_vlm`` (then its language model's vocabulary)."""
    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.hf.vlm import refuse_vlm, vlm_family

    if cfg.model.path and (Path(cfg.model.path) / "config.json").is_file():
        if allow_vlm and vlm_family(cfg.model.path) is not None:
            conf = _hf_config(cfg.model.path)
            vocab = conf.get("vocab_size") or (conf.get("text_config") or {}).get("vocab_size")
            return int(vocab) if vocab else None
        refuse_vlm(cfg.model.path, "rollout import")
        return arch_from_dir(cfg.model.path).vocab_size
    return None


_VISION_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def _hf_config(model_path: str) -> dict:
    try:
        conf = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return conf if isinstance(conf, dict) else {}


def model_vision(cfg: SlimectlConfig) -> tuple[dict[str, int] | None, bool]:
    """(a VLM's vision token ids from its config.json, whether ``model.path`` is known to be text-only)."""
    from slimectl.backends.hf.vlm import vlm_family

    if not cfg.model.path or not (Path(cfg.model.path) / "config.json").is_file():
        return None, False
    if vlm_family(cfg.model.path) is None:
        return None, True
    conf = _hf_config(cfg.model.path)
    ids = {k: conf.get(k, (conf.get("text_config") or {}).get(k)) for k in _VISION_TOKENS}
    return {k: int(v) for k, v in ids.items() if isinstance(v, int)}, False


def image_check(run: RunDir, cfg: SlimectlConfig) -> ImageCheck:
    """The image checks of ``run``'s samples: intact in its ``RUN/media``, as the model at ``model.path`` takes them."""
    vision, text_only = model_vision(cfg)
    return ImageCheck(run.path, vision, text_only)


def resolve_rollout_id(run: RunDir, rollout_id: int | None, force: bool) -> int:
    """``rollout_id``, or the next free id; refuses a published one unless ``force`` (hold the rollout lock)."""
    ids = run.rollouts.ids()
    rid = (ids[-1] + 1 if ids else 0) if rollout_id is None else rollout_id
    if run.rollouts.exists(rid) and not force:
        raise ArtifactExists(f"rollouts/{rid:06d} is already published; pass --force to replace it")
    return rid


def publish_samples(run: RunDir, cfg: SlimectlConfig, samples: list[Sample], rid: int, source_meta: dict,
                    stage: str, force: bool = False) -> ImportResult:
    """Publish checked samples made outside the rollout stage as ``rollouts/rid``.

    The caller holds the ``rollout`` lock. ``source_meta`` (``source`` and where the samples came
    from) goes into the manifest. The prompt-data state of rollout ``rid - 1`` is carried
    forward, so generated rollouts after this one continue the prompt data where it stopped.
    """
    for i, s in enumerate(samples):
        s.rollout_id = rid
        if s.index is None:
            s.index = i
        if s.status == Status.PENDING:
            s.status = Status.COMPLETED
    versions = {v for s in samples for v in s.weight_versions}
    rewards = [s.reward_value(cfg.rollout.reward_key) for s in samples]
    meta = {"rollout_id": rid, **source_meta,
            "weight_version": max(versions) if len(versions) == 1 else None,
            "num_samples": len(samples), "num_groups": len({s.group_index for s in samples}),
            "reward_mean": statistics.fmean(rewards)}
    state = run.rollouts.get(rid - 1).file(DATA_STATE).read_text() if rid > 0 and run.rollouts.exists(rid - 1) \
        and DATA_STATE in run.rollouts.get(rid - 1).files else "null"
    with run.rollouts.publish(rid, meta=meta, stage=stage, overwrite=force) as staging:
        write_samples(samples, staging / SAMPLES_FILE)
        (staging / DATA_STATE).write_text(state)
        (staging / "metrics.json").write_text(json.dumps({"rollout/reward_mean": meta["reward_mean"],
                                                          "rollout/num_samples": len(samples)}, indent=2))
    return ImportResult(rid, len(samples), run.rollouts.dir_for(rid))


def import_rollout(run: RunDir, cfg: SlimectlConfig, path: str | Path, rollout_id: int | None = None,
                   force: bool = False) -> ImportResult:
    path = Path(path)
    pairs = _load(path)
    vocab = model_vocab_size(cfg, allow_vlm=True)
    images = image_check(run, cfg)
    for where, s in pairs:
        check_sample(where, s, vocab, cfg.rollout.reward_key)
        images(where, s)
    with run.lock("rollout"):
        rid = resolve_rollout_id(run, rollout_id, force)
        return publish_samples(run, cfg, [s for _, s in pairs], rid,
                               {"source": "import", "imported_from": str(path.resolve())}, "rollout-import", force)
