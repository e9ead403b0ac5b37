"""Multi-turn agentic rollouts: the model acts, an environment (tools) answers, repeat.

Select it like any custom generate function (slime's signature)::

    rollout:
      custom_generate: slimectl.agents.multiturn:generate     # the sandboxed python tool
      # or your own: my_pkg.agent:generate, with generate = make_generate(my_env_factory, max_turns=6)

Token accounting. ``sample.tokens`` is the single source of truth and is never re-tokenized:

* the model's tokens of each turn are appended exactly as the engine returned them
  (``output_ids``), with loss mask 1 and the engine's log-probs;
* between turns, only the *new* text is tokenized and appended with loss mask 0 and log-prob 0:
  the rest of the chat template's end-of-turn marker that the model did not emit itself (``\\n``
  after ``<|im_end|>`` in ChatML), the tool message(s) as the chat template renders them, and
  the next assistant header. That text is cut out of the tokenizer's own chat template (see
  :class:`ChatTurnFormat`), so the transcript is what the template would render.

Re-tokenizing the whole transcript each turn would drift: the model may emit a token sequence
that is not the tokenizer's canonical split of its own text, and pieces merge differently
across turn boundaries. Appending only deltas keeps the training tokens equal to what the
engine actually saw and sampled.

Limits: ``max_turns`` (model turns), the response budget (``sampling_params["max_new_tokens"]``,
i.e. ``rollout.max_response_len``, counts model *and* observation tokens, as slime does), an
optional per-turn cap, and the model's context length (prompt + response). Hitting any of them
ends the sample with status ``truncated`` and ``metadata["reason"]`` saying which; an
observation that would not fit is not appended. The engine is never asked for more than fits,
and a context-length refusal from the engine (a limit we did not know) also ends the sample as
truncated. An exception inside the environment ends the sample with status ``failed``,
``remove_sample = True`` (no loss on it) and the error in ``metadata["reason"]``; the rollout
goes on.

Knobs are the keyword arguments of :func:`make_generate` (:class:`MultiTurnOptions`) and can be
overridden per prompt from the dataset's metadata: ``{"metadata": {"multiturn": {"max_turns": 2}}}``.
"""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol

from slimectl.engines.client import EngineError
from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.contract.samples import Sample, Status

log = logging.getLogger("slimectl.rollout")

METADATA_OPTIONS_KEY = "multiturn"
"""``sample.metadata[METADATA_OPTIONS_KEY]``: per-prompt overrides of :class:`MultiTurnOptions`."""


@dataclass
class Observation:
    """What the environment answers to one model turn.

    ``text``: the content of the message the model sees next (a list: one message per tool call,
    e.g. one ``<tool_response>`` each in Qwen's template); ``role``: that message's chat role
    (``tool``, or ``user`` for a simulated user). ``done``: the episode is over (the model's
    turn was final); nothing is appended. ``reward``: an optional environment reward, kept in
    ``metadata["env_reward"]`` for the reward function. ``info``: free-form, JSON-serialisable.
    """

    text: str | list[str] = ""
    done: bool = False
    reward: float | None = None
    role: str = "tool"
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    """Anything with ``async step(action_text) -> Observation``; an optional ``async close()`` is
    called when the sample's episode ends."""

    async def step(self, action_text: str) -> Observation: ...


EnvFactory = Callable[[Any, Sample], "Environment | Awaitable[Environment]"]


@dataclass(frozen=True)
class MultiTurnOptions:
    max_turns: int = 4
    """Most model turns per sample; a tool call in the last allowed turn is not answered."""
    max_tokens_per_turn: int | None = None
    """Cap on one model turn (default: whatever the response budget and context leave)."""
    max_context_len: int | None = None
    """The model's context length (prompt + response). Default: the engine's ``context-length``
    in ``engine.sglang_args``, else ``max_position_embeddings`` of ``model.path``'s config.json."""
    stop_after_tool_call: bool = False
    """Also stop a turn at ``</tool_call>`` (saves tokens when models write on after a call). The
    template's end-of-turn marker is then appended as observation, untrained."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens_per_turn", "max_context_len"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise UsageError(f"multi-turn option {name} = {v!r}: must be a positive integer")

    def with_overrides(self, overrides: Any) -> "MultiTurnOptions":
        if not overrides:
            return self
        if not isinstance(overrides, dict):
            raise UsageError(f"sample metadata {METADATA_OPTIONS_KEY!r} must be an object of multi-turn options")
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise UsageError(f"sample metadata {METADATA_OPTIONS_KEY!r}: unknown option(s) {unknown}; "
                             f"known: {sorted(known)}")
        return replace(self, **overrides)


# ---------------------------------------------------------------------------------- chat template

_SENTINEL = "\u2063SLIMECTL_TURN\u2063"


class ChatTurnFormat:
    """The text a tokenizer's chat template puts between two assistant turns.

    Rendered once with a sentinel assistant message: ``closer`` is what follows an assistant
    message's content (``<|im_end|>\\n`` in ChatML); :meth:`between_turns` renders the same
    conversation plus the observation message(s) with the generation prompt and returns the
    added text. Templates that refuse the ``tool`` role (or drop it) get Qwen2.5's convention: a
    ``user`` message holding one ``<tool_response>\\n...\\n</tool_response>`` block per result.
    """

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError("multi-turn rollouts need a tokenizer with a chat template (model.tokenizer_path); "
                             "this one has none")
        self.tokenizer = tokenizer
        self._base = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": _SENTINEL}]
        self._closed = self._render(self._base, False)
        at = self._closed.rfind(_SENTINEL)
        if at < 0:
            raise UsageError("the tokenizer's chat template drops assistant messages; cannot build multi-turn transcripts")
        self.closer = self._closed[at + len(_SENTINEL):]
        self.native_tool_role = self._supports_tool_role()

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _supports_tool_role(self) -> bool:
        probe = "\u2063TOOL\u2063"
        try:
            text = self._render(self._base + [{"role": "tool", "content": probe}], True)
        except Exception:  # jinja's raise_exception for an unknown role
            return False
        return probe in text and text.startswith(self._closed)

    def messages_for(self, obs: Observation) -> list[dict[str, Any]]:
        texts = [obs.text] if isinstance(obs.text, str) else list(obs.text)
        if obs.role != "tool" or self.native_tool_role:
            return [{"role": obs.role, "content": t} for t in texts]
        return [{"role": "user", "content": "\n".join(f"<tool_response>\n{t}\n</tool_response>" for t in texts)}]

    def between_turns(self, obs: Observation, emitted_closer: str = "") -> str:
        """Text from the end of the model's turn to the start of its next turn.

        ``emitted_closer``: the part of :attr:`closer` the model already produced (its EOS token's
        text when it stopped on it), which must not be added twice.
        """
        full = self._render(self._base + self.messages_for(obs), True)
        if not full.startswith(self._closed):
            raise UsageError("the tokenizer's chat template re-renders earlier turns when a message is added; "
                             "multi-turn token accounting needs a prefix-stable template")
        if not self.closer.startswith(emitted_closer):
            emitted_closer = ""
        return self.closer[len(emitted_closer):] + full[len(self._closed):]


_FORMATS: dict[int, tuple[Any, ChatTurnFormat]] = {}


def chat_turn_format(tokenizer) -> ChatTurnFormat:
    """One :class:`ChatTurnFormat` per tokenizer object (rendering probes once)."""
    hit = _FORMATS.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        hit = (tokenizer, ChatTurnFormat(tokenizer))
        _FORMATS[id(tokenizer)] = hit
    return hit[1]


def context_limit(args: Any, options: MultiTurnOptions) -> int | None:
    """The context length the engines enforce, as far as the config tells (None: unknown)."""
    if options.max_context_len is not None:
        return options.max_context_len
    cfg = getattr(args, "config", None)
    if cfg is None:
        return None
    if cfg.engine.backend == "sglang":
        for key in ("context-length", "context_length"):
            if cfg.engine.sglang_args.get(key):
                return int(cfg.engine.sglang_args[key])
    path = Path(cfg.model.path or "") / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    v = hf.get("max_position_embeddings") or (hf.get("text_config") or {}).get("max_position_embeddings")
    return int(v) if v else None


# ---------------------------------------------------------------------------------- the episode


def final_text(sample: Sample) -> str:
    """Text of the model's last turn (what a reward should grade, not the tool output)."""
    return sample.metadata.get("final_text", "")


def _end(sample: Sample, status: Status, reason: str) -> Sample:
    sample.status = status
    sample.metadata["reason"] = reason
    return sample


async def run_episode(args: Any, sample: Sample, sampling_params: dict[str, Any], env: Environment,
                      options: MultiTurnOptions) -> Sample:
    """Alternate model turns and environment steps on ``sample`` until done or a limit is hit.

    A sample aborted mid-turn (partial rollout) keeps its tokens and ``metadata["turn_start"]``
    and continues its interrupted turn when called again.
    """
    tok = args.tokenizer
    meta = sample.metadata
    meta.setdefault("turns", 0)
    meta.setdefault("tool_calls", [])
    turn_start = int(meta.get("turn_start", 0))  # a response without it is an unfinished first turn
    if sample.response_length and getattr(args, "mask_offpolicy", False):
        sample.loss_mask = [0] * sample.response_length
    limit = context_limit(args, options)
    budget = sampling_params.get("max_new_tokens")
    budget = int(budget) if budget is not None else None

    while True:
        if meta["turns"] >= options.max_turns:
            return _end(sample, Status.TRUNCATED, "max_turns")
        caps = _turn_caps(sample, limit, budget, options.max_tokens_per_turn, turn_start)
        binding = min(caps, key=caps.get) if caps else None
        if binding is not None and caps[binding] <= 0:
            return _end(sample, Status.TRUNCATED, binding)
        info = await _model_turn(args, sample, _turn_params(sampling_params, caps.get(binding), meta["turns"], options))
        if info is None:
            return _end(sample, Status.TRUNCATED, "context_limit")
        finish = info.get("finish_reason") or {}
        if finish.get("type") == "abort":
            meta["turn_start"] = turn_start
            return _end(sample, Status.ABORTED, "aborted")
        turn_text = tok.decode(sample.response_tokens[turn_start:], skip_special_tokens=True)
        meta["final_text"] = turn_text
        meta["turns"] += 1
        if finish.get("type") == "length":
            return _end(sample, Status.TRUNCATED, binding or "length")
        obs = await _environment_step(env, sample, turn_text)
        if not isinstance(obs, Observation):
            return obs  # (the sample, ended)
        ended = _append_observation(sample, obs, finish, chat_turn_format(tok), tok, limit, budget, options)
        if ended is not None:
            return ended
        turn_start = sample.response_length
        meta["turn_start"] = turn_start


def _turn_caps(sample: Sample, limit: int | None, budget: int | None, per_turn: int | None,
               turn_start: int) -> dict[str, int]:
    """The tokens the next turn may still generate under each limit that applies."""
    caps = {}
    if limit is not None:
        caps["context_limit"] = limit - len(sample.tokens)
    if budget is not None:
        caps["response_budget"] = budget - sample.response_length
    if per_turn is not None:
        caps["turn_length"] = per_turn - (sample.response_length - turn_start)
    return caps


def _turn_params(sampling_params: dict[str, Any], cap: int | None, turns: int, options: MultiTurnOptions) -> dict:
    """The sampling parameters of the next model turn: its token cap, a seed of its own, the tool-call stop."""
    params = dict(sampling_params)
    if cap is not None:
        params["max_new_tokens"] = cap
    else:
        params.pop("max_new_tokens", None)
    if params.get("sampling_seed") is not None:
        params["sampling_seed"] = int(params["sampling_seed"]) + turns  # a fresh stream per turn
    if options.stop_after_tool_call:
        from slimectl.agents.tools import TOOL_CALL_CLOSE

        stops = params.get("stop") or []
        params["stop"] = ([stops] if isinstance(stops, str) else list(stops)) + [TOOL_CALL_CLOSE]
    return params


async def _model_turn(args: Any, sample: Sample, params: dict[str, Any]) -> dict[str, Any] | None:
    """Generate one model turn onto ``sample``; the engine's ``meta_info`` (None: the context is full)."""
    try:
        extra = {"return_routed_experts": True, "routed_experts_start_len": len(sample.rollout_routed_experts or [])} \
            if getattr(args, "return_routed_experts", False) else {}  # MoE routing replay: extend the rows
        out = await args.pool.generate(input_ids=sample.tokens, sampling_params=params, return_logprob=True, **extra)
    except EngineError as exc:
        if exc.status == 400 and "context" in str(exc).lower():
            sample.metadata["engine_error"] = str(exc)
            return None
        raise
    info = out["meta_info"]
    ids = list(out["output_ids"])
    lps = [float(x[0]) for x in info.get("output_token_logprobs", [])]
    sample.append_response_tokens(ids, lps, True, info, args.tokenizer.decode(ids, skip_special_tokens=False))
    sample.metadata["engine_url"] = info.get("engine_url")
    return info


async def _environment_step(env: Environment, sample: Sample, turn_text: str) -> "Observation | Sample":
    """The environment's answer to the turn; the sample, ended, when the environment failed."""
    meta = sample.metadata
    try:
        obs = await env.step(turn_text)
        if not isinstance(obs, Observation):
            raise TypeError(f"step() returned {type(obs).__name__}, not an Observation")
    except Exception as exc:  # the environment's bug must not stop the rollout; the sample is dropped from the loss
        log.warning("sample %s: environment failed: %s: %s", sample.index, type(exc).__name__, exc)
        sample.remove_sample = True
        return _end(sample, Status.FAILED, f"env_error: {type(exc).__name__}: {exc}")
    for call in obs.info.get("tool_calls", []):
        meta["tool_calls"].append({"turn": meta["turns"], **call})
    if obs.reward is not None:
        meta["env_reward"] = obs.reward
    return obs


def _append_observation(sample: Sample, obs: Observation, finish: dict, fmt: "ChatTurnFormat", tok,
                        limit: int | None, budget: int | None, options: MultiTurnOptions) -> Sample | None:
    """The observation's tokens appended as the next turn's start (loss-masked); the sample, ended, when the
    episode is over (done, out of turns, or no room for the observation), else None."""
    meta = sample.metadata
    if obs.done:
        return _end(sample, Status.COMPLETED, str(obs.info.get("reason", "done")))
    if meta["turns"] >= options.max_turns:
        return _end(sample, Status.TRUNCATED, "max_turns")
    ids = sample.response_tokens
    emitted = ""
    if isinstance(finish.get("matched"), int) and ids and ids[-1] == finish["matched"]:
        emitted = tok.decode([ids[-1]], skip_special_tokens=False)
    text = fmt.between_turns(obs, emitted)
    obs_ids = tok.encode(text, add_special_tokens=False)
    if limit is not None and len(sample.tokens) + len(obs_ids) >= limit:
        meta["dropped_observation_tokens"] = len(obs_ids)
        return _end(sample, Status.TRUNCATED, "context_limit")
    if budget is not None and sample.response_length + len(obs_ids) >= budget:
        meta["dropped_observation_tokens"] = len(obs_ids)
        return _end(sample, Status.TRUNCATED, "response_budget")
    sample.append_response_tokens(obs_ids, None, False, None, text)
    return None


def make_generate(env_factory: EnvFactory, **options: Any) -> Callable[[Any, Sample, dict[str, Any]], Awaitable[Sample]]:
    """A slime-compatible ``async generate(args, sample, sampling_params)`` running episodes in the
    environment ``env_factory(args, sample)`` (sync or async) makes for each sample."""
    defaults = MultiTurnOptions(**options)

    async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
        if sample.status == Status.FAILED:
            return sample  # failed in an earlier rollout whose group was kept for later (partial rollout)
        opts = defaults.with_overrides(sample.metadata.get(METADATA_OPTIONS_KEY))
        env = env_factory(args, sample)
        if inspect.isawaitable(env):
            env = await env
        if not callable(getattr(env, "step", None)):
            raise SlimectlError(f"the environment factory returned {type(env).__name__}, which has no step()")
        try:
            return await run_episode(args, sample, sampling_params, env, opts)
        finally:
            await _close(env, sample)

    return generate


async def _close(env: Any, sample: Sample) -> None:
    """Call the environment's optional ``close()``; its failure is logged, the sample is already final."""
    close = getattr(env, "close", None)
    if close is None:
        return
    try:
        res = close()
        if inspect.isawaitable(res):
            await res
    except Exception as exc:
        log.warning("sample %s: environment close() failed: %s: %s", sample.index, type(exc).__name__, exc)


_DEFAULT_ENV = None


def python_tool_env(args: Any, sample: Sample):
    """The default environment: a :class:`~slimectl.agents.tools.ToolEnvironment` with the
    sandboxed ``python`` tool (shared by every sample of the process)."""
    global _DEFAULT_ENV
    if _DEFAULT_ENV is None:
        from slimectl.agents.tools import ToolEnvironment
        from slimectl.agents.tools.python_tool import PythonTool

        # The python tool enforces its own wall-time limit (and waiting for a free slot must not count).
        _DEFAULT_ENV = ToolEnvironment([PythonTool()], timeouts={"python": None})
    return _DEFAULT_ENV


generate = make_generate(python_tool_env)
"""``rollout.custom_generate: slimectl.agents.multiturn:generate`` — the python tool, default options."""
