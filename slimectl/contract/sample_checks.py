"""The checks of the Sample contract: a sample made outside slimectl, parsed and refused unless train can use it.

Each error names where the sample came from (a file line, a request). A sample is refused unless its
token ids are non-negative, within the model's vocabulary and fit the samples file's int32 column;
``response_length`` is positive and inside ``tokens``; the per-token lists (loss mask, log-probs) are
as long as the response; every field has the JSON type the samples file stores; its reward is a
finite number (or a dict holding one under the reward key); it has a ``group_index``; and its rollout
log-probs are log-probabilities (<= 0). Used by ``rollout import``, the rollout buffer service and the
rollout's buffer source alike.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.contract.samples import MEDIA_DIR, Sample


def parse_sample(where: str, d: object) -> Sample:
    """A decoded JSON value -> Sample; errors name ``where`` (a file line, a request's trajectory)."""
    if not isinstance(d, dict):
        raise SlimectlError(f"{where}: expected a JSON object with Sample fields")
    try:
        return Sample.from_dict(d)
    except (ValueError, TypeError) as exc:
        raise SlimectlError(f"{where}: {exc}") from None


_MAX_TOKEN_ID = 2**31 - 1


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _wrongly_typed_field(s: Sample) -> str | None:
    """What is wrong with the first field whose JSON type the samples file cannot store, or None."""
    for name in ("group_index", "index", "rollout_id"):
        v = getattr(s, name)
        if v is not None and not (_is_int(v) and -2**63 <= v < 2**63):
            return f"{name} must be an integer (64-bit)"
    if not _is_int(s.response_length):
        return "response_length must be an integer"
    if not isinstance(s.response, str):
        return "response must be a string"
    if not isinstance(s.prompt, (str, list)):
        return "prompt must be a string or a list of chat messages"
    if not isinstance(s.metadata, dict):
        return "metadata must be a JSON object"
    if not isinstance(s.weight_versions, list) or not all(isinstance(v, str) for v in s.weight_versions):
        return "weight_versions must be a list of strings"
    if not isinstance(s.remove_sample, bool):
        return "remove_sample must be true or false"
    if s.loss_mask is not None and (not isinstance(s.loss_mask, list) or not all(_is_int(m) for m in s.loss_mask)):
        return "loss_mask must be a list of 0/1 integers"
    for name in ("rollout_log_probs", "teacher_log_probs"):
        v = getattr(s, name)
        if v is not None and (not isinstance(v, list) or not all(_is_int(x) or isinstance(x, float) for x in v)
                              or not all(math.isfinite(x) for x in v)):
            return f"{name} must be a list of finite numbers"
    return None


def check_sample(where: str, s: Sample, vocab_size: int | None, reward_key: str | None) -> None:
    """Refuse a sample train could not use (the rules in the module docstring), naming ``where``.

    ``vocab_size``: token ids must be below it (None: unchecked); ``reward_key``: the key of a dict reward."""

    def bad(msg: str) -> SlimectlError:
        return SlimectlError(f"{where}: {msg}")

    if not isinstance(s.tokens, list) or not s.tokens or not all(_is_int(t) and t >= 0 for t in s.tokens):
        raise bad("tokens must be a non-empty list of non-negative token ids")
    if vocab_size is not None and max(s.tokens) >= vocab_size:
        raise bad(f"token id {max(s.tokens)} is outside the model's vocabulary ({vocab_size} ids)")
    if max(s.tokens) > _MAX_TOKEN_ID:
        raise bad(f"token id {max(s.tokens)} does not fit the samples file's int32 token column")
    wrong = _wrongly_typed_field(s)
    if wrong:
        raise bad(wrong)
    if s.response_length <= 0:
        raise bad("response_length must be > 0 (the tokens to train on are the last response_length)")
    try:
        s.validate()
    except ValueError as exc:
        raise bad(str(exc)) from None
    if s.group_index is None:
        raise bad("group_index is missing (samples of one prompt share a group_index)")
    if s.group_index < 0:
        raise bad(f"group_index must be >= 0, got {s.group_index}")
    if s.index is not None and s.index < 0:
        raise bad(f"index must be >= 0, got {s.index}")
    raw = s.reward.get(reward_key) if isinstance(s.reward, dict) and reward_key else s.reward
    if isinstance(raw, bool):
        raise bad(f"reward must be a number, not {str(raw).lower()}")
    try:
        value = s.reward_value(reward_key)
    except (SlimectlError, KeyError, TypeError, ValueError) as exc:
        raise bad(f"no usable reward ({exc})") from None
    if not math.isfinite(value):
        raise bad(f"reward is {value} (it must be a finite number)")
    if s.rollout_log_probs is not None and any(x > 1e-6 for x in s.rollout_log_probs):
        raise bad("rollout_log_probs must be <= 0 (they are log-probabilities)")


def stored_image_problem(run_path: str | Path, sha256: str) -> str | None:
    """What is wrong with ``RUN/media/<sha256>.png`` (missing, unreadable, bytes not hashing to its name), or None."""
    path = Path(run_path) / MEDIA_DIR / f"{sha256}.png"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return f"{path} does not exist"
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror or exc})"
    if hashlib.sha256(data).hexdigest() != sha256:
        return f"{path}: its bytes do not hash to its name (changed after it was stored)"
    return None


def check_sample_images(where: str, s: Sample, run_path: str | Path, vision_ids: dict[str, int] | None,
                        text_only: bool) -> None:
    """Refuse a sample whose images train could not see as the engine did: an image for a text-only model
    (``text_only``), a referenced image not intact in ``RUN/media``, and for a VLM (``vision_ids``: its config's
    ``image_token_id``, ``vision_start_token_id``, ...) a prompt whose image count is not the references' or a
    vision token in the response's trained tokens (image tokens are prompt tokens, never in the loss mask). Each is
    one line, exit 2 (:class:`UsageError`: bad input)."""
    hashes = s.image_hashes
    if hashes and text_only:
        raise UsageError(f"{where}: multimodal_inputs has {len(hashes)} images but model.path is a text-only model")
    for sha in dict.fromkeys(hashes):
        problem = stored_image_problem(run_path, sha)
        if problem:
            raise UsageError(f"{where}: its image {sha} is not in the run's {MEDIA_DIR}/ ({problem}); copy the "
                                f"image there as {MEDIA_DIR}/<sha256 of its PNG bytes>.png")
    if not vision_ids:
        return
    start = vision_ids.get("vision_start_token_id")
    if start is not None and s.prompt_tokens.count(start) != len(hashes):
        raise UsageError(f"{where}: its prompt holds {s.prompt_tokens.count(start)} images (vision_start tokens) "
                            f"but multimodal_inputs refers to {len(hashes)}")
    mask = s.loss_mask or [1] * s.response_length
    trained = {t for t, m in zip(s.response_tokens, mask) if m}
    bad = sorted(trained & set(vision_ids.values()))
    if bad:
        raise UsageError(f"{where}: vision token {bad[0]} is in the response's trained tokens (loss mask 1); "
                            f"image tokens are prompt tokens, never in the loss mask")


@dataclass(frozen=True)
class ImageCheck:
    """:func:`check_sample_images` bound to one run: its directory (``RUN/media``) and its model's vision token ids
    (None: not a VLM) or whether it is known to be text-only. ``rollout import``, the rollout buffer service served
    with ``-r RUN`` and the rollout's buffer source check VLM samples with it."""

    run_path: Path
    vision_ids: dict[str, int] | None
    text_only: bool

    def __call__(self, where: str, s: Sample) -> None:
        check_sample_images(where, s, self.run_path, self.vision_ids, self.text_only)
