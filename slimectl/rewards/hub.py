"""The reward hub: pick a grader by name, or a custom function by import path, or a remote model.

Resolution order for one sample (slime's ``rm_hub.async_rm``):

1. ``sample.custom_rm_path`` (per eval dataset), then ``custom_rm_path=`` (``--custom-rm-path``,
   also read from ``args.custom_rm_path``): ``fn(args, sample)`` is called and its float or dict
   returned;
2. otherwise the reward type: ``sample.metadata["rm_type"]``, else ``rm_type=`` (the run-wide
   default, ``--rm-type``; also read from ``args.rm_type``). A ``boxed_`` prefix first replaces the
   response by the content of its last ``\\boxed{}`` ("" if none), then grades with the rest of the
   name (``boxed_f1``); ``boxed_math`` is plain ``math``, which grades the last box anyway.

Names: ``math``, ``math_verify`` (Hugging Face's Math-Verify, in worker processes: :mod:`.math_verify`;
settings from ``args.config.rollout.math_verify``), ``deepscaler``, ``dapo`` (returns a dict: use
``reward_key="score"``), ``f1``,
``gpqa``, ``last_number``, ``gsm8k`` (the number after ``####``), ``random``, ``remote`` (alias ``remote_rm``; ``remote=`` client, else ``rm_url=``, else
``args.rm_url``). Anything else is a :class:`RewardConfigError`.

Custom functions (``"package.module:function"`` or slime's ``"package.module.function"``)::

    async def rm(args, sample) -> float | dict            # per sample
    async def batched_rm(args, samples) -> list            # group form: group_rm=True

Plain ``def`` functions work too. ``args`` is whatever the caller passes (slime passes its
argparse namespace; here it may be None). Rule-based graders run inline on the event loop; they
are bounded (a 1 MB response grades in milliseconds); ``math_verify`` is awaited on worker
processes, each sample bounded by ``rollout.math_verify.timeout_s``.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from slimectl.contract.imports import import_object
from slimectl.contract.reward_names import BOXED_PREFIX, GRADER_NAMES, JUDGE_NAMES, REMOTE_NAMES
from slimectl.contract.reward_names import is_custom_reward as is_custom_reward
from slimectl.contract.reward_names import reward_names, unknown_reward_message

from .boxed import last_boxed
from .dapo import grade_dapo
from .errors import RewardConfigError, RewardError, one_line
from .math_grader import grade_deepscaler, grade_math
from .math_verify import MATH_VERIFY, grade_math_verify, grade_math_verify_async, require_math_verify, settings_from
from .numeric import grade_gsm8k, grade_last_number
from .remote import RemoteRewardModel, shared_remote
from .text import grade_f1, grade_gpqa, grade_random


@dataclass
class RewardInput:
    """The minimal sample-like object the hub reads (the real ``Sample`` has the same attributes)."""

    prompt: Any = ""
    response: str = ""
    label: Any = None
    metadata: dict = field(default_factory=dict)
    custom_rm_path: str | None = None
    index: int | None = None


def _random(response: str, label: Any, metadata: dict, sample: Any) -> float:
    rid = metadata.get("rid")
    if rid is None:
        rid = getattr(sample, "index", None)
    return grade_random(response, label, seed=metadata.get("seed", 0), rid=rid)


#: name -> fn(response, label, metadata, sample) for the rule-based graders.
GRADERS: dict[str, Callable[[str, Any, dict, Any], float | dict]] = {
    "math": lambda r, lab, md, s: grade_math(r, lab),
    "deepscaler": lambda r, lab, md, s: grade_deepscaler(r, lab),
    "dapo": lambda r, lab, md, s: grade_dapo(r, lab),
    "f1": lambda r, lab, md, s: grade_f1(r, lab),
    "gpqa": lambda r, lab, md, s: grade_gpqa(r, lab, metadata=md),
    "last_number": lambda r, lab, md, s: grade_last_number(r, lab),
    "gsm8k": lambda r, lab, md, s: grade_gsm8k(r, lab),
    "random": _random,
    "math_verify": lambda r, lab, md, s: grade_math_verify(r, lab),
}
assert tuple(sorted(GRADERS)) == tuple(sorted(GRADER_NAMES)), "slimectl/contract/reward_names.py names the graders"
#: Built-in graders that never read the label (every other built-in grades against it).
LABEL_FREE: tuple[str, ...] = ("random",)


def rm_types() -> list[str]:
    """Every name :func:`compute_reward` accepts (``boxed_<name>`` works for each as well)."""
    return reward_names()


def _split_name(rm_type: str) -> tuple[bool, str]:
    name = rm_type.strip()
    boxed = name.startswith(BOXED_PREFIX)
    base = name[len(BOXED_PREFIX):] if boxed else name
    if base not in GRADERS and base not in REMOTE_NAMES and name not in JUDGE_NAMES:
        raise RewardConfigError(unknown_reward_message(rm_type))
    return boxed and base != "math", base


def needs_label(reward: str) -> bool | None:
    """Whether reward ``reward`` (a hub name or a custom import path) grades against the sample's label.

    True for the built-in graders (``math``, ``deepscaler``, ``dapo``, ``f1``, ``gpqa`` and their
    ``boxed_`` forms), False for ``random``, None when it cannot be told: a custom function or a
    remote reward model may or may not read the label. Unknown names raise :class:`RewardConfigError`, and so
    does ``math_verify`` without Math-Verify installed (the rollout asks this before contacting any engine).
    """
    if is_custom_reward(reward):
        return None
    _, base = _split_name(reward)
    if base == MATH_VERIFY:
        require_math_verify()
    if base in REMOTE_NAMES or base in JUDGE_NAMES:
        return None
    return base not in LABEL_FREE


def grade(rm_type: str, response: str | None, label: Any, metadata: dict | None = None, *,
          sample: Any = None) -> float | dict:
    """Run a rule-based grader by name, synchronously (``remote`` needs :func:`compute_reward`)."""
    boxed, base = _split_name(rm_type)
    if base in REMOTE_NAMES:
        raise RewardConfigError(f"reward type {rm_type!r} is remote: use compute_reward, not grade")
    if base in JUDGE_NAMES:
        raise RewardConfigError(_JUDGE_ELSEWHERE)
    response = response if isinstance(response, str) else ("" if response is None else str(response))
    if boxed:
        response = last_boxed(response) or ""
    return GRADERS[base](response, label, metadata if isinstance(metadata, dict) else {}, sample)


# ------------------------------------------------------------------------------ custom functions

def load_reward_function(path: str, *, group: bool = False) -> Callable:
    """Import ``"module:function"`` or ``"module.function"`` and check it takes ``(args, sample)``.

    ``group=True`` only changes the wording (``(args, samples)``). Raises :class:`RewardConfigError`
    with a one-line message naming ``path`` when the module or attribute is missing, importing
    fails, or the object is not callable with two positional arguments.
    """
    want = "(args, samples)" if group else "(args, sample)"
    obj = import_object(path, "custom reward", RewardConfigError, callable_as=f"a function {want}")
    text = str(path).strip()
    attr = text.partition(":")[2] if ":" in text else text.rpartition(".")[2]
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return obj  # builtins and C callables without a signature: trust them
    try:
        sig.bind(None, None)
    except TypeError:
        raise RewardConfigError(f"custom reward {path!r} has signature {attr}{sig}; it must accept {want}") from None
    return obj


async def _call(fn: Callable, args: Any, arg: Any) -> Any:
    result = fn(args, arg)
    if inspect.isawaitable(result):
        result = await result
    return result


def _check_reward(path: str, value: Any, where: str = "") -> float | dict:
    if isinstance(value, (int, float, dict)):
        return value
    raise RewardError(f"custom reward {path!r} returned {type(value).__name__}{where}; expected a number or a dict")


# ------------------------------------------------------------------------------ the hub

_UNSET: Any = object()
_JUDGE_ELSEWHERE = ("the judge reward asks the engines of rollout.judge (slimectl.rewards.judge.JudgeReward, built "
                    "by the rollout); it has no per-sample grader here")


async def compute_reward(sample: Any, rm_type: str | None = None, label: Any = _UNSET, *, args: Any = None,
                         custom_rm_path: str | None = None, remote: RemoteRewardModel | None = None,
                         rm_url: str | None = None) -> float | dict:
    """The reward of one sample-like object (``prompt``, ``response``, ``label``, ``metadata``).

    ``rm_type`` is the default type (a sample's ``metadata["rm_type"]`` wins, as in slime);
    ``label`` overrides ``sample.label`` for the built-in graders. See the module doc for the order.
    """
    path = getattr(sample, "custom_rm_path", None) or custom_rm_path or getattr(args, "custom_rm_path", None)
    if path:
        fn = load_reward_function(path)
        return _check_reward(path, await _call(fn, args, sample))

    metadata = getattr(sample, "metadata", None)
    metadata = metadata if isinstance(metadata, dict) else {}
    name = str(metadata.get("rm_type") or rm_type or getattr(args, "rm_type", None) or "").strip()
    if not name:
        raise RewardConfigError("no reward type: pass rm_type, set metadata['rm_type'] or a custom_rm_path")
    response = getattr(sample, "response", None)
    label = getattr(sample, "label", None) if label is _UNSET else label
    boxed, base = _split_name(name)
    if base in REMOTE_NAMES:
        if remote is None:
            url = rm_url or getattr(args, "rm_url", None)
            if not url:
                raise RewardConfigError(f"reward type {name!r} needs rm_url (--rm-url) or a RemoteRewardModel")
            remote = shared_remote(url)
        if boxed:
            response = last_boxed(response) or ""
        return await remote.score(getattr(sample, "prompt", None), response, label)
    if base in JUDGE_NAMES:
        raise RewardConfigError(_JUDGE_ELSEWHERE)
    if base == MATH_VERIFY:  # worker processes, awaited: the event loop goes on meanwhile
        if boxed:
            box = last_boxed(response)
            response = "\\boxed{" + box + "}" if box else ""
        return await grade_math_verify_async(response, label, settings_from(args))
    return grade(name, response, label, metadata, sample=sample)


async def compute_rewards(samples: Iterable[Any], rm_type: str | None = None, *, args: Any = None,
                          custom_rm_path: str | None = None, group_rm: bool | None = None,
                          remote: RemoteRewardModel | None = None, rm_url: str | None = None) -> list:
    """Rewards of a group, in order (slime's ``batched_async_rm``).

    With ``group_rm`` (default ``args.group_rm``, else False) and a custom path, the custom function
    gets the whole list once and must return one reward per sample; otherwise every sample goes
    through :func:`compute_reward` concurrently.
    """
    samples = list(samples)
    path = custom_rm_path or getattr(args, "custom_rm_path", None)
    group = bool(getattr(args, "group_rm", False)) if group_rm is None else group_rm
    if path and group:
        fn = load_reward_function(path, group=True)
        out = await _call(fn, args, samples)
        if not isinstance(out, (list, tuple)):
            raise RewardError(f"custom group reward {path!r} returned {type(out).__name__}; expected a list "
                              f"of {len(samples)} rewards")
        if len(out) != len(samples):
            raise RewardError(f"custom group reward {path!r} returned {len(out)} rewards for {len(samples)} samples")
        return [_check_reward(path, v, f" at position {i}") for i, v in enumerate(out)]
    return list(await asyncio.gather(*(
        compute_reward(s, rm_type, args=args, custom_rm_path=custom_rm_path, remote=remote, rm_url=rm_url)
        for s in samples)))


def reward_value(reward: Any, reward_key: str | None = None) -> float:
    """The scalar of a reward: the number itself, or ``reward[reward_key]`` for a dict (``--reward-key``)."""
    if isinstance(reward, dict):
        if not reward_key:
            raise RewardError(f"reward is a dict with keys {sorted(reward)}; set reward_key (--reward-key)")
        if reward_key not in reward:
            raise RewardError(f"reward_key {reward_key!r} is not in the reward dict (keys: {sorted(reward)})")
        reward = reward[reward_key]
    if isinstance(reward, (int, float)):
        return float(reward)
    raise RewardError(f"reward {one_line(repr(reward), 80)} is not a number")
