"""The config schema: one typed section per part of a run (model, data, rollout, engine, train, algorithm,
critic, sync, logging), each field with its type, default, range and docstring (``docs/config.md`` is
generated from it), and which sections each stage may override. Loading, ``--set`` overrides and the
one-line errors: :mod:`slimectl.contract.config`.

pydantic is used for the schema: it is already a dependency of transformers' hub client,
and gives typed coercion, range checks and Literal choices for free.
"""

from __future__ import annotations

import hashlib
import json
import types
from typing import Any, Literal, Optional, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

import slimectl.contract.algorithm_names as algo_registry
from slimectl.contract.config_checks import algorithm_conflict, critic_problem, lora_problem, off_policy_problem
from slimectl.contract.errors import ConfigError
from slimectl.contract.reward_names import base_reward_name, is_custom_reward, unknown_reward_message

CONFIG_VERSION = 1


class Section(BaseModel):
    """Base for every config section: unknown keys fail, assignments are re-validated.

    The docstring under each field is its description (``Field.description``), which
    ``docs/config.md`` is generated from (``python scripts/config_doc.py``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, use_attribute_docstrings=True,
                              allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: Any) -> Any:
        """``batch_size: true`` is a mistake, not 1 (pydantic would take it as 1). YAML reads a bare ``off``
        (``on``) as false (true): a choice that offers "off" ("on") gets the word back
        (``--set rollout.async_mode=off``)."""
        if isinstance(value, bool):
            annotation = cls.model_fields[info.field_name].annotation
            if _is_number(annotation):
                raise ValueError("must be a number, not true/false")
            word = "on" if value else "off"
            if word in _literal_choices(annotation):
                return word
        return value


def _literal_choices(annotation: Any) -> tuple:
    """The choices of a ``Literal`` field (possibly Optional); () for any other type."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(c for a in get_args(annotation) for c in _literal_choices(a))
    return ()


def section_type(annotation: Any) -> type[BaseModel] | None:
    """The section class a field holds (``Optional[LoraSection]`` too: an optional nested section), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        if len(inner) == 1 and isinstance(inner[0], type) and issubclass(inner[0], BaseModel):
            return inner[0]
    return None


def _is_number(annotation: Any) -> bool:
    """Whether a field holds an int or float (possibly Optional): a boolean there is refused."""
    if annotation in (int, float):
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        args = get_args(annotation)
        return bool not in args and any(a in (int, float) for a in args)
    return False


class ModelSection(Section):
    """The policy model the run starts from."""

    path: Optional[str] = None
    """HF model directory (config.json + safetensors + tokenizer) of the initial policy."""
    tokenizer_path: Optional[str] = None
    """Tokenizer directory, when it is not inside ``path``."""
    ref_path: Optional[str] = None
    """Reference model for the KL loss (default: ``path``)."""
    adapter_path: Optional[str] = None
    """A PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) trained on
    ``path``, to start a LoRA run from instead of B = 0 (needs ``train.lora`` with the adapter's rank, alpha
    and target modules)."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Parameter dtype for training and engines (fp32 on CPU for exact logprob parity)."""


#: The modalities ``data.multimodal_keys`` may name (slime also reads video and audio; not built yet).
MULTIMODAL_MODALITIES = ("image",)


class DataSection(Section):
    """The prompt data source (jsonl or parquet)."""

    prompt_data: Optional[str] = None
    """Prompt dataset: ``file.jsonl``, ``file.parquet``, optionally sliced as ``path@[a:b]``."""
    input_key: str = "input"
    """Field of each row holding the prompt (a string, or a chat message list)."""
    label_key: Optional[str] = "label"
    """Field holding the label the reward grades against; null when the reward needs none."""
    metadata_key: str = "metadata"
    """Field holding a per-row object passed to rewards and custom functions as ``sample.metadata``."""
    tools_key: str = "tools"
    """Field holding the row's tool definitions (multi-turn rollouts)."""
    apply_chat_template: bool = True
    """Wrap each prompt in the tokenizer's chat template before tokenizing."""
    max_prompt_len: Optional[int] = Field(default=None, gt=0)
    """Prompts longer than this many tokens are filtered out."""
    shuffle: bool = True
    """Visit the prompts in a shuffled order (reshuffled every epoch)."""
    seed: int = 42
    """Seed of the prompt shuffle."""
    skip_bad_rows: bool = False
    """Skip (and count) malformed rows instead of failing on the first one."""
    eval_data: dict[str, str] = Field(default_factory=dict)
    """Evaluation datasets, ``{name: file.jsonl|file.parquet}`` (same keys as prompt_data)."""
    multimodal_keys: dict[str, str] = Field(default_factory=dict)
    """Multimodal inputs of each row, ``{modality: column}`` (slime's ``--multimodal-keys``), e.g.
    ``{image: images}``: the column holds an image or a list of them, as file paths (relative to the dataset's
    folder), base64 strings (``data:image/...;base64,`` optional) or bytes (Parquet). Only ``image`` for now,
    and only with a vision-language model."""

    @field_validator("multimodal_keys")
    @classmethod
    def _known_modalities(cls, value: dict[str, str]) -> dict[str, str]:
        for modality, column in value.items():
            if modality not in MULTIMODAL_MODALITIES:
                raise ValueError(f"modality {modality!r} is not supported; one of: {', '.join(MULTIMODAL_MODALITIES)}")
            if not column:
                raise ValueError(f"{modality}: the column name is empty")
        return value


MATH_VERIFY_EXTRACTIONS = ("latex", "expr")


class MathVerifySection(Section):
    """The ``math_verify`` reward (Hugging Face's Math-Verify, ``pip install 'slimectl[math]'``): how the label and
    the response are parsed, and each sample's time bound (docs/rewards.md)."""

    answer_extraction: list[Literal[MATH_VERIFY_EXTRACTIONS]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: ["latex", "expr"], min_length=1)
    """What Math-Verify looks for in the response: ``latex`` (``$...$``, ``\\[...\\]``, ``\\boxed{}``; its
    LatexExtractionConfig) and/or ``expr`` (plain expressions such as ``1/2`` or ``3.5``; ExprExtractionConfig)."""
    label_extraction: list[Literal[MATH_VERIFY_EXTRACTIONS]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: ["latex", "expr"], min_length=1)
    """What Math-Verify looks for in the label (a label with no LaTeX delimiter is read as ``\\boxed{label}``)."""
    boxed_first: bool = True
    """A ``\\boxed{}`` in the response wins over every other answer (Math-Verify's boxed_match_priority 0, as
    open-r1); false: a "final answer is ..." sentence wins over a box (Math-Verify's default, 50)."""
    last_answer: bool = True
    """With no box and no "answer" anchor, the last LaTeX or expression of the response is its answer
    (Math-Verify's try_extract_without_anchor); false: such a response has no answer."""
    timeout_s: float = Field(default=5.0, gt=0, le=600)
    """Most seconds one sample's verification may take (parsing both sides and comparing); past it the
    sample scores 0.0. Runs in worker processes, so the rollout's event loop never waits on it."""
    format_penalty: float = Field(default=0.0, ge=0)
    """A response Math-Verify extracts no answer from scores minus this (0: such a response scores 0.0)."""
    workers: int = Field(default=2, gt=0, le=64)
    """Worker processes verifying samples in parallel (each imports Math-Verify once, ~1 s)."""


JUDGE_PLACEHOLDERS = ("prompt", "response", "label")
DEFAULT_JUDGE_TEMPLATE = ("Question:\n{prompt}\n\nReference answer: {label}\n\nResponse:\n{response}\n\n"
                          "Is the response correct? Answer with a score between 0 and 1.\nScore:")


class JudgeSection(Section):
    """The ``judge`` reward: a generative reward model (an LLM judge) on a frozen engine group
    (``engine.groups``) or at a URL, as slime's remote RM is used with a model behind it (docs/engine-groups.md).
    Each sample's prompt, response and label fill ``template``; the judge's reply (its verdict) is parsed into the
    reward and recorded in the sample's ``metadata["judge"]``."""

    group: Optional[str] = None
    """The engine group serving the judge (a name in ``engine.groups``; its live engines from ``RUN/engines/groups/``,
    balanced with fail-over)."""
    urls: list[str] = Field(default_factory=list)
    """Judge engines started elsewhere (SGLang's ``/generate``), instead of ``group``."""
    template: str = DEFAULT_JUDGE_TEMPLATE
    """The judge's prompt (sent as text, no chat template): ``{prompt}``, ``{response}`` and ``{label}`` are
    replaced by the sample's (``{{``/``}}`` for literal braces)."""
    parser: Literal["score", "yes_no", "regex"] = "score"
    """How the verdict becomes the reward: ``score``, the first number in it, kept if in [0, 1]; ``yes_no``, 1.0 for a
    verdict starting with yes (or true, correct), 0.0 for no (false, incorrect); ``regex``, the number ``regex``'s
    first group captures. A verdict the parser finds nothing in is an error (``on_error``)."""
    regex: Optional[str] = None
    """The ``regex`` parser's pattern (Python ``re``, searched in the verdict; its first group a number)."""
    chat_template: bool = False
    """Send the filled template as one user message in the judge model's chat template (what an instruct judge
    expects; its tokenizer from the group's model, or ``tokenizer_path`` with ``urls``); false: as raw text."""
    tokenizer_path: Optional[str] = None
    """With ``urls`` and ``chat_template``: the judge model's tokenizer directory."""
    max_tokens: int = Field(default=16, gt=0)
    """Most tokens of a verdict."""
    temperature: float = Field(default=0.0, ge=0)
    """The judge's sampling temperature (0: greedy)."""
    concurrency: int = Field(default=16, gt=0)
    """Most judge requests in flight at once (in all)."""
    timeout_s: float = Field(default=60.0, gt=0)
    """Seconds one verdict may take (fail-over to another engine of the group included)."""
    on_error: Literal["zero", "fail"] = "zero"
    """A verdict that fails (timeout, no engine, nothing parsed): ``zero`` scores the sample 0.0 (counted in
    ``metadata["judge"]["error"]``); ``fail`` stops the rollout with that line."""

    @model_validator(mode="after")
    def _check(self) -> "JudgeSection":
        import re
        import string

        for _, field, _, _ in string.Formatter().parse(self.template):
            if field is not None and field not in JUDGE_PLACEHOLDERS:
                shown = "{" + field + "}"
                raise ValueError(f"rollout.judge.template: unknown placeholder {shown}; use {{prompt}}, "
                                 f"{{response}}, {{label}} (and {{{{ }}}} for literal braces)")
        if self.parser == "regex":
            if not self.regex:
                raise ValueError("rollout.judge.parser is regex but rollout.judge.regex is unset; set a pattern "
                                 "whose first group captures the score")
            try:
                if re.compile(self.regex).groups < 1:
                    raise ValueError("rollout.judge.regex has no group; put the score in parentheses")
            except re.error as exc:
                raise ValueError(f"rollout.judge.regex does not compile: {exc}") from None
        if self.group and self.urls:
            raise ValueError("rollout.judge sets both group and urls; keep one")
        if self.chat_template and self.urls and not self.tokenizer_path:
            raise ValueError("rollout.judge.chat_template with rollout.judge.urls needs rollout.judge.tokenizer_path "
                             "(the judge model's tokenizer directory)")
        return self


AGENT_GENERATE = "slimectl.agents.harness_generate:generate"
"""The custom generate that runs ``rollout.agent`` against the harness."""


class RolloutSection(Section):
    """How rollouts are generated and scored."""

    num_rollout: int = Field(default=10, gt=0)
    """How many rollouts (RL iterations) the run makes."""
    batch_size: int = Field(default=8, gt=0)
    """Prompts per rollout."""
    n_samples_per_prompt: int = Field(default=4, gt=0)
    """Responses generated per prompt (the group size of GRPO-style estimators)."""
    over_sampling_batch_size: Optional[int] = Field(default=None, gt=0)
    """Prompts in flight per generation round (default: ``batch_size``)."""
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature; also the temperature the trainer's log-probs use. 0 samples greedily
    (SGLang's top_k 1), and its log-probs are those of the unscaled distribution (temperature 1), as SGLang reports them."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches this."""
    top_k: int = Field(default=-1, ge=-1)
    """Sample among the k most likely tokens; -1 for all."""
    max_response_len: int = Field(default=16, gt=0)
    """Most tokens generated per response."""
    stop: list[str] = Field(default_factory=list)
    """Strings that end a response."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Token ids that end a response (besides the tokenizer's EOS)."""
    reward: str = "math"
    """A reward-hub name (math, math_verify, deepscaler, dapo, f1, gpqa, last_number, gsm8k, remote, random; each
    also as boxed_NAME) or a custom ``module:function`` (docs/rewards.md)."""
    math_verify: MathVerifySection = Field(default_factory=MathVerifySection)
    """Settings of the ``math_verify`` reward (used only when a sample is graded with it)."""
    reward_key: Optional[str] = None
    """Key to read when the reward function returns a dict."""
    group_reward: bool = False
    """Call the custom reward once per group instead of once per sample."""
    remote_reward_url: Optional[str] = None
    """Reward-model server the ``remote`` reward posts samples to."""
    custom_generate: Optional[str] = None
    """``module:function`` of an async custom generate function."""
    agent: Optional[str] = None
    """``module:function`` of an agent program each sample runs against a harness on 127.0.0.1
    (``custom_generate: slimectl.agents.harness_generate:generate``; docs/agent-harness.md): ``run(base_url, api_key,
    row)`` returns the reward."""
    agent_timeout_s: Optional[float] = Field(default=None, gt=0)
    """Longest run of one agent call; past it the sample fails (no loss). Default: no limit."""
    dynamic_filter: Optional[str] = None
    """``nonzero_std`` or ``module:function`` deciding whether to keep a group."""
    partial_rollout: bool = False
    """Keep the groups still generating when a rollout has its batch and continue them in the next rollout."""
    mask_offpolicy_in_partial_rollout: bool = False
    """With partial_rollout: mask the tokens generated in an earlier rollout (older weights) out of the loss."""
    return_routed_experts: bool = False
    """MoE: ask the engines for the experts each MoE layer chose per token (SGLang's
    ``return_routed_experts``; real SGLang needs ``--enable-return-routed-experts``) and store them
    on each sample (``rollout_routed_experts``). Also on when ``train.use_rollout_routing_replay`` is."""
    concurrency_per_engine: int = Field(default=64, gt=0)
    """Most requests in flight to one engine."""
    seed: int = 42
    """Seed of each sample's sampling seed (with the rollout id and sample index)."""
    teacher_urls: list[str] = Field(default_factory=list)
    """On-policy distillation: engines serving the teacher (e.g. another ``slimectl serve``); each
    sample gets the teacher's log-probs of its response tokens (``/generate``, max_new_tokens 0)."""
    teacher_group: Optional[str] = None
    """On-policy distillation from a frozen engine group (a name in ``engine.groups``): its live engines are the
    teacher, as ``teacher_urls`` would be (the two add up)."""
    judge: JudgeSection = Field(default_factory=JudgeSection)
    """Settings of the ``judge`` reward (used only when ``reward`` is judge)."""
    async_mode: Literal["off", "one_step_off", "fully_async"] = "off"
    """``slimectl rl``: ``one_step_off`` generates rollout N+1 (on weights N) while rollout N trains;
    ``fully_async`` generates all the time (``rollout --follow``, ``train --follow`` and ``sync --follow``
    in one command): a rollout is published as soon as its batch is scored, and weights are loaded into the
    engines while requests are in flight (docs/async.md)."""
    max_staleness: Optional[int] = Field(default=None, ge=0)
    """How many weight versions generation may run ahead of the newest published ``weights/N``: ``rollout``
    refuses an engine further behind (sync it first), and ``fully_async`` starts no group for rollout R
    while R - N exceeds it. Default: what async_mode implies, 0 for off, 1 for one_step_off and fully_async."""
    stale_samples: Optional[Literal["drop", "keep"]] = None
    """A group with a token sampled more than max_staleness versions before the weights it is trained from:
    ``drop`` masks it out of the loss, ``keep`` trains on it (the off-policy correction weighs it); either way
    it is counted (``rollout/stale_dropped``, ``train/staleness_mean``, ``train/staleness_max``).
    Default: drop under fully_async, keep otherwise."""
    eval_interval: Optional[int] = Field(default=None, gt=0)
    """``slimectl rl``: evaluate on data.eval_data every this many weight versions (and at the end)."""
    eval_n_samples: int = Field(default=4, gt=0)
    """Samples per eval prompt (pass@k needs k <= this)."""
    eval_pass_k: list[int] = Field(default_factory=lambda: [1])
    """The k of each pass@k reported by eval."""
    eval_temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature of eval (0: greedy)."""
    eval_max_response_len: Optional[int] = Field(default=None, gt=0)
    """Default: max_response_len."""

    @field_validator("reward")
    @classmethod
    def _known_reward(cls, value: str) -> str:
        """An unknown name is refused when the config is loaded (``init`` too), not at the first rollout."""
        if not is_custom_reward(value) and base_reward_name(value) is None:
            raise ValueError(unknown_reward_message(value))
        return value

    @model_validator(mode="after")
    def _check(self) -> "RolloutSection":
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size < self.batch_size:
            raise ValueError(
                f"rollout.over_sampling_batch_size ({self.over_sampling_batch_size}) must be >= "
                f"rollout.batch_size ({self.batch_size})"
            )
        if any(not 1 <= k <= self.eval_n_samples for k in self.eval_pass_k):
            raise ValueError(f"rollout.eval_pass_k = {self.eval_pass_k}: each k must be in 1..rollout.eval_n_samples "
                             f"({self.eval_n_samples})")
        if self.custom_generate == AGENT_GENERATE and not self.agent:
            raise ValueError(f"rollout.custom_generate is {AGENT_GENERATE} but rollout.agent is unset; set it to "
                             f"your agent program's module:function")
        if self.agent and self.custom_generate != AGENT_GENERATE:
            raise ValueError(f"rollout.agent is set but rollout.custom_generate is {self.custom_generate!r}; set "
                             f"rollout.custom_generate: {AGENT_GENERATE} (it runs the agent)")
        return self


class HealthCheckSection(Section):
    """The heartbeat on the engines ``serve`` and ``rl`` start (slime's ``--use-fault-tolerance`` and
    ``--rollout-health-check-*``): an engine whose process dies, or that does not answer ``GET /health_generate``
    within ``timeout``, is killed (its whole process group), started again on the same port, brought to the
    weight version it was on (full weights from ``weights/N``, read back and checked) and registered again."""

    enabled: bool = True
    """Watch the engines (false: an engine that dies stops ``rl``; a hung one is not detected)."""
    first_wait: float = Field(default=300.0, ge=0)
    """Seconds after the engines are up before the first heartbeat (a dead process is seen at once)."""
    interval: float = Field(default=10.0, gt=0)
    """Seconds between heartbeats."""
    timeout: float = Field(default=5.0, gt=0)
    """Seconds ``/health_generate`` may take before the engine counts as hung."""


#: What an engine group's name may hold (it names its registry folder ``RUN/engines/groups/NAME/``).
GROUP_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"
#: ``engine`` keys a group's ``options`` may not set: the group has its own key for them, or they are the
#: actor's alone (its router, its LoRA weights, the group list itself).
GROUP_OPTIONS_REFUSED = ("name", "groups", "backend", "num_engines", "urls", "health_check", "router",
                         "router_python", "lora_merged", "offload_during_train")


class EngineGroupSection(Section):
    """A named group of engines beside the actor's (``engine.groups``; slime's ``--sglang-config`` models): an
    on-policy-distillation teacher, a judge, a reference. ``serve`` (and ``rl`` with engines of its own) starts it
    from its own ``model`` at weight version 0, registers its engines in ``RUN/engines/groups/NAME/`` and keeps
    them healthy; no sync ever reaches it and rollouts never generate on it. ``rollout.teacher_group`` and
    ``rollout.judge.group`` reach it by name (docs/engine-groups.md)."""

    name: str = Field(pattern=GROUP_NAME_PATTERN)
    """The group's name (letters, digits, ``_``, ``.``, ``-``)."""
    update_weights: bool = False
    """Whether the group takes the trained weights. Only the actor's group does (``engine:`` itself, named
    ``engine.name``): an entry with true must carry that name and nothing else but ``name``."""
    model: Optional[str] = None
    """HF model directory the group serves (default: ``model.path``, the actor's initial weights)."""
    num_engines: int = Field(default=1, gt=0)
    """How many engines the group has."""
    backend: Optional[Literal["embedded", "sglang", "external"]] = None
    """embedded, sglang or external (``urls``); default: ``engine.backend``, or external when ``urls`` is set."""
    urls: list[str] = Field(default_factory=list)
    """Engines of this group started elsewhere (backend external): health-checked and registered only."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Other ``engine`` keys for this group only (``tp_size``, ``gpu_ids``, ``sglang_args``, ``env``,
    ``mem_fraction_static``, ``max_batch_size``, ``num_threads``, ``port``, ...; slime's per-group
    ``overrides``); unset keys are the actor's ``engine`` values, except ``port`` (free ports) and ``gpu_ids``
    (each engine picks) that a group sets for itself."""
    health_check: Optional[HealthCheckSection] = None
    """The group's heartbeat (default: ``engine.health_check``)."""

    def problem(self) -> str | None:
        """What is wrong with this entry on its own (checked by :class:`EngineSection`, whose key the line names)."""
        bad = sorted(k for k in self.options if k in GROUP_OPTIONS_REFUSED)
        if bad:
            return (f"engine.groups[{self.name}].options may not set {', '.join(bad)} (a group key of its own, or "
                    f"the actor's alone); set it beside options, or drop it")
        if self.urls and self.backend not in (None, "external"):
            return (f"engine.groups[{self.name}]: urls are engines started elsewhere (backend external), but backend "
                    f"is {self.backend}; drop urls or the backend")
        return None

    @property
    def effective_backend(self) -> str | None:
        """``backend``, external when ``urls`` are given, else None (the actor's)."""
        return self.backend or ("external" if self.urls else None)


class EngineSection(Section):
    """Inference engines that speak SGLang's HTTP protocol."""

    backend: Literal["embedded", "sglang", "external"] = "embedded"
    """embedded: our CPU engine (default); sglang: real SGLang servers; external: ``urls``."""
    lora_merged: Optional[bool] = None
    """A LoRA run (``train.lora``): true gives the engines full weights, the base with the adapter merged in, at
    every sync (rollouts then ask for no adapter); false has them serve the adapter itself. null: true for SGLang on
    CPU (``sglang_args.device: cpu``: its LoRA layers need a GPU), false otherwise."""
    num_engines: int = Field(default=1, gt=0)
    """How many engines ``serve`` (or ``rl``) starts."""
    host: str = "127.0.0.1"
    """Interface the engines bind to; keep loopback unless other hosts must reach them."""
    advertise_host: Optional[str] = None
    """Address other hosts use to reach the engines, recorded in ``RUN/engines/`` (default: ``host``;
    when that is a wildcard such as 0.0.0.0, this machine's address on its default route)."""
    port: int = Field(default=0, ge=0, le=65535)
    """First port (0 = pick free ports)."""
    urls: list[str] = Field(default_factory=list)
    """Engines started elsewhere (backend ``external``)."""
    token_env: str = "SLIMECTL_ENGINE_TOKEN"
    """Environment variable holding the admin/weight-update token (never stored in the run dir)."""
    tp_size: int = Field(default=1, gt=0)
    """Tensor-parallel size of each engine (SGLang)."""
    gpu_ids: list[int] = Field(default_factory=list)
    """GPUs for the engines, tp_size per engine in order (SGLang; default: let each engine pick)."""
    mem_fraction_static: Optional[float] = Field(default=None, gt=0, le=1)
    """SGLang's ``--mem-fraction-static`` (default: SGLang's)."""
    offload_during_train: bool = False
    """``slimectl rl`` (synchronous loop, colocated): engines release their weights and KV cache
    while the actor trains (``/release_memory_occupation``) and take them back for the sync, which
    loads the new weights — SGLang frees GPU memory; the embedded engine frees its host memory
    (its RSS drops by the weight bytes)."""
    num_threads: Optional[int] = Field(default=None, gt=0)
    """Torch threads of each embedded engine. Default: the CPUs this process may use, less one, shared
    among the engines ``serve`` starts here (at least 1), unless ``env`` or the environment sets
    ``OMP_NUM_THREADS``. The core left free is the trainer's background checkpoint writer's: an engine
    whose threads fill every core stalls whenever anything else runs (each parallel op waits for its
    preempted thread; on 2 cores a rollout of SmolLM2-135M beside one busy core took 14.7 s with 2
    threads, 9.3 s with 1, and 10.3 s vs 10.2 s alone)."""
    sglang_python: Optional[str] = None
    """Interpreter that has sglang installed (sglang pins its own torch)."""
    sglang_args: dict[str, Any] = Field(default_factory=dict)
    """Extra ``--flag value`` pairs passed to ``sglang.launch_server`` verbatim."""
    router: bool = False
    """``serve`` (or ``rl``) starts sglang-router in front of the engines it launches (backend sglang or
    embedded; not external) and records it in ``RUN/engines/routers/``; rollout sends ``/generate``
    through it, while weight updates, pause, continue and abort still go to each engine (the router
    does not forward them)."""
    router_python: Optional[str] = None
    """Interpreter that has ``sglang_router`` installed (``pip install sglang-router``; default:
    ``sglang_python``, else the one running slimectl)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables (name: string) set for every engine process ``serve`` (or ``rl``) launches,
    embedded or SGLang, on top of its own environment. SGLang on CPU needs ``env: {SGLANG_USE_CPU_ENGINE: "1"}``
    with ``sglang_args: {device: cpu, attention_backend: torch_native, sampling_backend: pytorch}``.
    Not for the token (``token_env``): the run directory stores this."""

    @field_validator("env", mode="before")
    @classmethod
    def _env_strings(cls, value: Any) -> Any:
        """Names must be variable names; numbers become strings (``1`` -> ``"1"``), true/false/null are refused."""
        if not isinstance(value, dict):
            return value
        out = {}
        for k, v in value.items():
            if not (isinstance(k, str) and k.isascii() and k.replace("_", "a").isalnum() and not k[0].isdigit()):
                raise ValueError(f"{k!r} is not an environment variable name (letters, digits, _)")
            if isinstance(v, bool) or v is None:
                raise ValueError(f"{k}: {v!r} is not a string; quote the value (e.g. \"1\")")
            if isinstance(v, (int, float)):
                v = str(v)
            if isinstance(v, str) and "\0" in v:
                raise ValueError(f"{k}: the value holds a NUL character")
            out[k] = v
        return out

    def token(self) -> str | None:
        """The admin/weight-update token from the environment variable ``token_env`` (None when unset or empty)."""
        import os

        return os.environ.get(self.token_env) or None

    @model_validator(mode="after")
    def _router_needs_launched_engines(self) -> "EngineSection":
        if self.router and (self.backend == "external" or self.urls):
            raise ValueError("engine.router starts sglang-router in front of the engines serve launches, not external "
                             "ones (engine.backend external / engine.urls): set engine.router: false, or engine.backend "
                             "sglang or embedded")
        return self

    @model_validator(mode="after")
    def _token_not_in_env(self) -> "EngineSection":
        if self.token_env in self.env:
            raise ValueError(f"engine.env sets {self.token_env}, the engine token (engine.token_env): set it in "
                             f"serve's environment instead; the run directory never stores the token")
        return self
    max_batch_size: int = Field(default=64, gt=0)
    """Embedded engine: most sequences decoded together."""
    startup_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds an engine may take to become healthy (also how long a rollout with every engine out waits for
    one the heartbeat is starting again)."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds one request to an engine may take."""
    health_check: HealthCheckSection = Field(default_factory=HealthCheckSection)
    """The heartbeat that restarts dead or hung engines (see above)."""
    on_lost: Literal["continue", "stop"] = "continue"
    """An engine that cannot be restarted (its model gone, its port taken): continue (the run goes on with the
    others, one line says which was lost) or stop (``rl`` stops with that line, exit 1)."""
    name: str = Field(default="actor", pattern=GROUP_NAME_PATTERN)
    """The name of the actor's engine group (this section): what ``rollout.teacher_group`` or
    ``rollout.judge.group`` would call it, and what ``status`` shows."""
    groups: list[EngineGroupSection] = Field(default_factory=list)
    """Frozen engine groups served beside the actor's (a teacher, a judge, a reference; slime's
    ``--sglang-config`` models with ``update_weights: false``): each ``{name, model, num_engines, backend, urls,
    options, update_weights, health_check}`` (docs/engine-groups.md). Never synced; rollouts never use them."""

    @model_validator(mode="after")
    def _groups_check(self) -> "EngineSection":
        seen = {self.name: "engine.name (the actor's group)"}
        for g in self.groups:
            if g.name in seen:
                if g.name != self.name:
                    raise ValueError(f"engine.groups: two groups are named {g.name!r}; give each its own name")
                if not g.update_weights:
                    raise ValueError(f"engine.groups[{g.name}] is frozen (update_weights: false) but {g.name!r} is the "
                                     f"actor's group (engine.name), which takes the trained weights; rename the group "
                                     f"or set engine.name to another name")
                if g.model_fields_set - {"name", "update_weights"}:
                    raise ValueError(f"engine.groups[{g.name}] is the actor's group: set its engines in engine: "
                                     f"itself, and keep only name and update_weights in its entry")
                seen[g.name] = "the actor's entry"
                continue
            if g.update_weights:
                raise ValueError(f"engine.groups[{g.name}] has update_weights: true, but the actor's group is "
                                 f"engine: ({self.name!r}) and there can be only one: set update_weights: false, "
                                 f"or name it {self.name!r}")
            seen[g.name] = "a group"
            if g.problem():
                raise ValueError(g.problem())
            self.group_engine(g)  # its options, checked now
        return self

    @property
    def frozen_groups(self) -> list[EngineGroupSection]:
        """The groups that never take trained weights."""
        return [g for g in self.groups if not g.update_weights]

    def group_names(self) -> list[str]:
        """Every group's name, the actor's first."""
        return [self.name] + [g.name for g in self.frozen_groups]

    def group_engine(self, group: EngineGroupSection) -> "EngineSection":
        """The ``engine`` section of a frozen group: the actor's, its options and keys on top, no groups."""
        base = self.model_dump(exclude={"groups", "name", "router", "router_python", "lora_merged",
                                        "offload_during_train", "urls", "backend", "port", "gpu_ids"})
        backend = group.effective_backend or self.backend
        if backend == "external" and not group.urls:
            raise ValueError(f"engine.groups[{group.name}] is external (engines started elsewhere) but lists no urls; "
                             f"set its urls, or its backend to embedded or sglang")
        base.update(group.options, num_engines=len(group.urls) or group.num_engines, urls=list(group.urls),
                    name=group.name, backend=backend)
        if group.health_check is not None:
            base["health_check"] = group.health_check.model_dump()
        try:
            return EngineSection.model_validate(base)
        except ValueError as exc:
            from pydantic import ValidationError

            if not isinstance(exc, ValidationError):
                raise
            first = exc.errors()[0]
            loc = ".".join(str(x) for x in first["loc"])
            msg = "not an engine key" if first["type"] == "extra_forbidden" else first["msg"]
            raise ValueError(f"engine.groups[{group.name}].options: {loc}: {msg}") from None


LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers LoRA adapts, named as PEFT users write them (``all-linear``: every one)."""


class LoraSection(Section):
    """LoRA adapters trained instead of the full weights (PEFT's ``LoraConfig``): ``W x + alpha/rank * B A x``
    on each target module, B zero at the start (step 0 is the base model), the base frozen."""

    rank: int = Field(default=8, gt=0)
    """Rank r of each adapter (PEFT's ``r``)."""
    alpha: float = Field(default=16.0, gt=0)
    """Scale numerator (PEFT's ``lora_alpha``): the adapter's output is scaled by alpha / rank."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on each adapter's input in training forwards (PEFT's ``lora_dropout``)."""
    target_modules: Union[Literal["all-linear"], list[str]] = "all-linear"
    """The layers adapted: a list of ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``,
    ``up_proj``, ``down_proj``, or ``all-linear`` (all seven; the output layer never)."""

    @field_validator("target_modules", mode="before")
    @classmethod
    def _known_targets(cls, value: Any) -> Any:
        if isinstance(value, str) and value != "all-linear":
            value = [value]  # one module named alone
        if isinstance(value, list):
            if not value:
                raise ValueError("must name at least one module, or be all-linear")
            for name in value:
                if name not in LORA_TARGET_MODULES:
                    raise ValueError(f"unknown target module {name!r}; choose from {', '.join(LORA_TARGET_MODULES)} "
                                     f"or all-linear")
        return value

    @property
    def modules(self) -> tuple[str, ...]:
        """The target modules, ``all-linear`` resolved, in a fixed order."""
        if self.target_modules == "all-linear":
            return LORA_TARGET_MODULES
        return tuple(m for m in LORA_TARGET_MODULES if m in self.target_modules)

    @property
    def scale(self) -> float:
        """alpha / rank."""
        return self.alpha / self.rank


FREEZABLE_PARTS = ("vision", "language")
"""``train.freeze``'s names (slimectl.backends.megatron.vlm.apply_freeze)."""


class MtpSection(Section):
    """Multi-token-prediction (MTP) layers trained online during RL (slime's ``--mtp-num-layers N
    --enable-mtp-training --mtp-loss-scaling-factor S``), for models whose checkpoint has them (GLM-4.5,
    DeepSeek-V3: ``num_nextn_predict_layers``). The MTP loss (next-next-token cross entropy over the response
    tokens) trains the MTP layers only, as slime's does; logged as ``train/mtp_loss``."""

    num_layers: int = Field(default=0, ge=0)
    """MTP layers trained: the model's ``num_nextn_predict_layers``, or 0 (not trained: carried through unchanged
    from convert to export and to the engines)."""
    loss_scale: float = Field(default=0.2, ge=0)
    """Weight of the MTP loss beside the policy loss (megatron-core's ``mtp_loss_scaling_factor``: each layer's
    loss times loss_scale / num_layers)."""


class TrainSection(Section):
    """The Megatron actor."""

    tp: int = Field(default=1, gt=0)
    """Tensor-parallel size of the actor."""
    pp: int = Field(default=1, gt=0)
    """Pipeline-parallel size of the actor."""
    dp: int = Field(default=1, gt=0)
    """Data-parallel ranks: ``slimectl train`` runs tp*pp*dp processes under torchrun."""
    ep: int = Field(default=1, gt=0)
    """Expert-parallel size of the actor (MoE models only): each MoE layer's experts are split over ep
    of the data-parallel ranks (megatron-core's ``expert_model_parallel_size``, expert-TP = tp), so ep
    must divide dp and the model's number of experts."""
    moe_aux_loss_coeff: float = Field(default=0.0, ge=0)
    """Coefficient of the MoE load-balancing auxiliary loss added to the policy loss (slime's
    ``--moe-aux-loss-coeff``; 0 disables it; MoE models only)."""
    lr: float = Field(default=1e-6, ge=0)
    """Peak learning rate (Adam)."""
    min_lr: float = Field(default=0.0, ge=0)
    """Learning rate at the end of the decay (linear, cosine)."""
    lr_warmup_steps: int = Field(default=0, ge=0)
    """Optimizer steps of linear warmup from 0 to lr."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warmup, over rollout.num_rollout x num_steps_per_rollout steps."""
    weight_decay: float = Field(default=0.0, ge=0)
    """Adam weight decay."""
    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    """Adam beta1."""
    adam_beta2: float = Field(default=0.98, ge=0, lt=1)
    """Adam beta2."""
    adam_eps: float = Field(default=1e-8, gt=0)
    """Adam epsilon."""
    clip_grad: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this; 0 disables clipping."""
    global_batch_size: Optional[int] = Field(default=None, gt=0)
    """Samples per optimizer step (default: all samples of a rollout / num_steps_per_rollout)."""
    num_steps_per_rollout: int = Field(default=1, gt=0)
    """Optimizer steps per rollout (the rollout's samples split into that many global batches)."""
    max_tokens_per_micro_batch: int = Field(default=4096, gt=0)
    """Token budget of one packed micro-batch."""
    share_prompts: bool = True
    """Pack the samples of one prompt (identical prompt tokens: a GRPO group) as the prompt once, then
    their responses, each attending to the prompt and to itself: the prompt's forward and backward are
    paid once per group (the CPU demo: 1,792 rows -> 504 per rollout). Same log-probs and gradients up
    to float rounding. Off by itself with routing replay (routes are recorded per sample) and rotary
    variants other than plain RoPE."""
    recompute: Literal["auto", "none", "full"] = "auto"
    """Activation recompute in the training backward (slime's ``--recompute-granularity``; megatron-core's
    own): ``full`` keeps only each recompute unit's input and runs its forward again in the backward,
    ``none`` keeps every layer's activations; same gradients to rounding. ``auto``: ``full`` for a dense
    model with pp 1 and no routing replay, else ``none`` (SmolLM2-135M, 16 x 62 tokens: trainer peak
    39.8 -> 25.6 B/param for +0-12 % CPU; MoE models refuse ``full``)."""
    recompute_method: Literal["uniform", "block"] = "uniform"
    """Which layers ``recompute: full`` recomputes (slime's ``--recompute-method``): ``uniform`` all of
    them in units of recompute_num_layers layers, ``block`` the first recompute_num_layers layers of
    each pipeline stage."""
    recompute_num_layers: int = Field(default=1, gt=0)
    """Layers per recompute unit (uniform: must divide a pipeline stage's layers) or layers recomputed
    per stage (block) (slime's ``--recompute-num-layers``)."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer state over data-parallel ranks (Megatron's distributed optimizer)."""
    use_rollout_logprobs: bool = False
    """Take old log-probs from the rollout instead of recomputing them."""
    use_rollout_routing_replay: bool = False
    """MoE routing replay (slime's ``--use-rollout-routing-replay``, R3): every forward of a sample
    (old log-probs, training, reference) routes each token to the experts the engine chose in rollout
    (``rollout_routed_experts``); rollout then records them (as ``rollout.return_routed_experts``)."""
    save_interval: int = Field(default=1, gt=0)
    """Publish a checkpoint (``checkpoints/N``) every this many rollouts (and after the last)."""
    keep_checkpoints: Optional[int] = Field(default=2, gt=0)
    """Checkpoints kept (older ones are deleted; the initial checkpoint 0 is always kept); null keeps all."""
    seed: int = 1234
    """Seed of the actor's initialisation and dropout."""
    mtp: MtpSection = Field(default_factory=MtpSection)
    """Multi-token-prediction layers trained online (``train.mtp.num_layers > 0``)."""
    lora: Optional[LoraSection] = None
    """LoRA: train adapters on the frozen base instead of the full weights (``weights/N`` is then a PEFT
    adapter); null trains every weight."""
    freeze: list[str] = Field(default_factory=list)
    """Parts of the model that are not trained (no gradients, no optimizer state): ``vision`` (a vision-language
    model's vision tower and merger) and/or ``language`` (the language model: embedding, layers, output layer);
    [] trains every weight."""

    @field_validator("freeze")
    @classmethod
    def _known_parts(cls, value: list[str]) -> list[str]:
        for name in value:
            if name not in FREEZABLE_PARTS:
                raise ValueError(f"{name!r} is not a part that can be frozen; use any of {', '.join(FREEZABLE_PARTS)}")
        if set(value) >= set(FREEZABLE_PARTS):
            raise ValueError(f"{value} freezes every part of the model, nothing would be trained; drop one")
        return list(dict.fromkeys(value))

    @property
    def world_size(self) -> int:
        """The trainer's ranks: ``tp * pp * dp``."""
        return self.tp * self.pp * self.dp

    @model_validator(mode="after")
    def _check(self) -> "TrainSection":
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr ({self.min_lr}) must be <= train.lr ({self.lr})")
        if self.dp % self.ep:
            raise ValueError(f"train.ep ({self.ep}) must divide train.dp ({self.dp}): expert-parallel ranks are "
                             f"data-parallel ranks (megatron-core: tp*ep*pp must divide tp*pp*dp); "
                             f"set train.dp to a multiple of {self.ep}")
        if self.mtp.num_layers and self.lora is not None:
            raise ValueError(f"train.mtp.num_layers = {self.mtp.num_layers} with train.lora: the MTP layers are not "
                             f"trained with LoRA adapters; set train.mtp.num_layers: 0 or train.lora: null")
        if self.mtp.num_layers and self.pp > 1:
            raise ValueError(f"train.mtp.num_layers = {self.mtp.num_layers} trains at train.pp 1 (the MTP layers, "
                             f"on the last stage, need the embedding); set train.pp: 1 or train.mtp.num_layers: 0")
        return self


HOOK_KEYS = ("custom_tis_function", "custom_loss_function", "custom_advantage_function", "custom_pg_loss_reducer")
"""The algorithm keys that name a custom function (``module:function``)."""


class AlgorithmSection(Section):
    """Advantages, policy loss and regularisers (``docs/algorithms.md``: each formula and its slime flag)."""

    _hooks: Optional[tuple] = PrivateAttr(default=None)

    # choices and defaults come from the algorithm registry (one list, shared with the math)
    advantage_estimator: Literal[algo_registry.ESTIMATORS + algo_registry.CRITIC_ESTIMATORS] = algo_registry.DEFAULT_ESTIMATOR  # type: ignore[valid-type]
    """How rewards become advantages; ppo: GAE with a learned critic (the ``critic`` section, on the actor's ranks)."""
    loss_type: Literal[algo_registry.LOSS_TYPES] = algo_registry.DEFAULT_LOSS_TYPE  # type: ignore[valid-type]
    """policy_loss (PPO-style clipped surrogate), sft_loss (negative log-likelihood of the responses) or
    custom_loss (``custom_loss_function``)."""
    reward_normalization: Optional[Literal[algo_registry.REWARD_NORM_MODES]] = algo_registry.DEFAULT_REWARD_NORM  # type: ignore[valid-type]
    """Per-group reward normalization before the advantages: subtract the group mean (and divide by
    its std), or none. Default (null): slime's rule for the estimator — group_mean_std for
    grpo/gspo/cispo, group_mean for reinforce_plus_plus_baseline, none for reinforce_plus_plus."""
    normalize_advantages: Optional[bool] = None
    """Whiten the advantages over all loss tokens of the rollout (slime ``--normalize-advantages``).
    Default (null): on for both reinforce_plus_plus estimators (slime requires it), off otherwise."""
    eps_clip: float = Field(default=algo_registry.DEFAULT_EPS_CLIP, gt=0)
    """PPO clip range: the ratio is clipped to [1 - eps_clip, 1 + eps_clip_high]."""
    eps_clip_high: Optional[float] = Field(default=None, gt=0)
    """Upper clip (clip-higher); default ``eps_clip``."""
    eps_clip_c: Optional[float] = Field(default=None, gt=1)
    """Dual-clip constant (> 1); off when unset."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus: the loss gets ``- entropy_coef * mean entropy``."""
    use_kl_loss: bool = False
    """Add a KL loss against the reference model (model.ref_path); also what builds the reference model."""
    kl_loss_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL loss."""
    kl_loss_type: Literal[algo_registry.KL_TYPES] = algo_registry.DEFAULT_KL_LOSS_TYPE  # type: ignore[valid-type]
    """KL estimator of the KL loss and of the kl_coef reward penalty (slime's default k1)."""
    ref_update_interval: Optional[int] = Field(default=None, ge=1)
    """Copy the actor into the reference model after every N rollouts (slime ``--ref-update-interval``;
    needs use_kl_loss). Checkpoints then carry the reference, so a resume restores the moved one."""
    use_unbiased_kl: bool = False
    """Multiply the KL loss per token by ``pi_theta / pi_old`` (DeepSeek-V3.2; slime ``--use-unbiased-kl``)."""
    kl_coef: float = Field(default=0.0, ge=0)
    """KL penalty folded into the reward (reinforce_plus_plus estimators; needs use_kl_loss for the reference)."""
    gamma: float = Field(default=algo_registry.DEFAULT_GAMMA, ge=0, le=1)
    """Discount of the per-token returns (reinforce_plus_plus and ppo; slime ``--gamma``)."""
    lambd: float = Field(default=algo_registry.DEFAULT_LAMBD, ge=0, le=1)
    """GAE lambda of ppo's advantages (slime ``--lambd``): 1 = discounted return minus value, 0 = one-step TD error."""
    use_tis: bool = False
    """Truncated importance sampling: weight the loss by the trainer/engine probability ratio, clamped
    to [tis_clip_low, tis_clip]."""
    tis_mode: Literal[algo_registry.TIS_MODES] = algo_registry.DEFAULT_TIS_MODE  # type: ignore[valid-type]
    """truncate: clamp the TIS weight into [tis_clip_low, tis_clip]; mask: weight 0 for tokens whose ratio
    leaves that range (slime's icepop_function)."""
    tis_clip: float = Field(default=algo_registry.DEFAULT_TIS_CLIP, gt=0)
    """Upper clamp of the TIS weights."""
    tis_clip_low: float = Field(default=algo_registry.DEFAULT_TIS_CLIP_LOW, ge=0)
    """Lower clamp of the TIS weights."""
    custom_tis_function: Optional[str] = None
    """``module:function`` replacing the TIS weighting, slime's signature
    ``fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kw) -> (pg_loss, loss_masks, metrics)``
    (needs use_tis)."""
    use_decoupled_loss: bool = False
    """AReaL's decoupled PPO objective: the PPO ratio against the proximal policy (the trainer's log-probs before
    the rollout's first update), times the behaviour weight ``exp(proximal - rollout)`` per token; tokens whose
    weight exceeds behav_imp_weight_cap leave the loss. The same as use_tis with tis_mode mask, tis_clip_low 0
    and tis_clip = the cap (docs/algorithms.md). Needs the rollout log-probs and train.use_rollout_logprobs false."""
    behav_imp_weight_cap: Optional[float] = Field(default=None, gt=1)
    """use_decoupled_loss: tokens whose behaviour weight is above this leave the loss (AReaL's
    ``behav_imp_weight_cap``, > 1); unset: every token kept, the weight uncapped."""
    use_opsm: bool = False
    """Off-policy sequence masking: drop sequences with a negative advantage whose mean ``old_lp - lp``
    exceeds opsm_delta (slime ``--use-opsm``)."""
    opsm_delta: float = Field(default=algo_registry.DEFAULT_OPSM_DELTA, ge=0)
    """OPSM threshold on the sequence's mean ``old_lp - lp``."""
    use_opd: bool = False
    """On-policy distillation: add the reverse KL to the teacher's log-probs (rollout.teacher_urls)."""
    opd_kl_coef: float = Field(default=algo_registry.DEFAULT_OPD_KL_COEF, ge=0)
    """Weight of the on-policy distillation term."""
    calculate_per_token_loss: bool = False
    """Reduce the loss per token over the batch instead of per-sample mean."""
    custom_loss_function: Optional[str] = None
    """``module:function`` of loss_type custom_loss, slime's signature
    ``fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)``."""
    custom_advantage_function: Optional[str] = None
    """``module:function`` replacing the advantage estimator, slime's signature ``fn(args, rollout_data) -> None``
    (sets ``rollout_data["advantages"]`` and ``["returns"]``)."""
    custom_pg_loss_reducer: Optional[str] = None
    """``module:function`` building the pg_loss reducer, slime's signature
    ``fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer``."""

    @model_validator(mode="after")
    def _check(self) -> "AlgorithmSection":
        problem = algorithm_conflict(self)
        if problem:
            raise ValueError(problem)
        return self

    # The defaults a null key stands for, resolved here once (the math reads these, never the raw keys).
    @property
    def effective_eps_clip_high(self) -> float:
        """The upper clip: ``eps_clip_high``, or ``eps_clip`` when unset."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def effective_use_tis(self) -> bool:
        """The loss is weighted by ``exp(trainer_old - rollout)`` per token: ``use_tis`` or ``use_decoupled_loss``."""
        return self.use_tis or self.use_decoupled_loss

    @property
    def effective_tis_mode(self) -> str:
        """``tis_mode``, or ``mask`` under ``use_decoupled_loss`` (AReaL drops the tokens above its cap)."""
        return "mask" if self.use_decoupled_loss else self.tis_mode

    @property
    def effective_tis_clip(self) -> float:
        """``tis_clip``, or under ``use_decoupled_loss`` ``behav_imp_weight_cap`` (unset: no cap, ``inf``)."""
        if self.use_decoupled_loss:
            return float("inf") if self.behav_imp_weight_cap is None else self.behav_imp_weight_cap
        return self.tis_clip

    @property
    def effective_tis_clip_low(self) -> float:
        """``tis_clip_low``, or 0 under ``use_decoupled_loss`` (AReaL caps the behaviour weight above only)."""
        return 0.0 if self.use_decoupled_loss else self.tis_clip_low

    @property
    def effective_reward_normalization(self) -> str:
        """``reward_normalization``, or slime's rule for the estimator when unset."""
        return self.reward_normalization or algo_registry.default_reward_norm(self.advantage_estimator)

    @property
    def effective_normalize_advantages(self) -> bool:
        """``normalize_advantages``, or slime's requirement for the estimator when unset."""
        if self.normalize_advantages is None:
            return algo_registry.default_normalize_advantages(self.advantage_estimator)
        return self.normalize_advantages

    @property
    def reduction(self) -> str:
        """The loss reduction: ``token_mean`` with calculate_per_token_loss, else ``sample_mean``."""
        return "token_mean" if self.calculate_per_token_loss else "sample_mean"

    @property
    def hooks(self) -> dict[str, Any]:
        """The custom functions this section names, imported once (``contract/imports.py``), by field name."""
        specs = tuple((key, getattr(self, key)) for key in HOOK_KEYS if getattr(self, key))
        if self._hooks is None or self._hooks[0] != specs:
            from slimectl.contract.imports import import_object

            self._hooks = (specs, {key: import_object(spec, f"algorithm.{key}", ConfigError, callable_as="a function")
                                   for key, spec in specs})
        return self._hooks[1]


class CriticSection(Section):
    """PPO's value model (``algorithm.advantage_estimator: ppo``; slime ``--use-critic``, ``--value-clip``,
    ``--num-critic-only-steps`` and the critic role of ``--megatron-config-path``). A key left null takes the
    actor's value from ``train``. Unused by the other estimators. Placement: ``slimectl train``, a local ``rl`` (and its torchrun ranks) run the critic in the trainer's
    processes, on the actor's layout (``critic.tp``/``pp``/``dp`` unset or equal to ``train``'s). Under
    ``rl --launcher ray`` the critic is its own group of Ray actors (slime's critic RayTrainGroup):
    ``critic.tp x critic.pp x critic.dp`` ranks with their own torch.distributed world and Megatron layout,
    which may differ from the actor's; placed like the trainer (own bundles, or sharing the ``--colocate``
    bundles)."""

    path: Optional[str] = None
    """HF model directory the critic's transformer starts from (same architecture as the actor; its LM head is
    replaced by a value head); null: the actor's initial weights (``model.path``)."""
    lr: Optional[float] = Field(default=None, ge=0)
    """Peak learning rate of the critic's Adam; null: ``train.lr``."""
    min_lr: Optional[float] = Field(default=None, ge=0)
    """Learning rate at the end of the critic's decay; null: ``train.min_lr``."""
    lr_warmup_steps: Optional[int] = Field(default=None, ge=0)
    """Critic optimizer steps of linear warmup; null: ``train.lr_warmup_steps``."""
    lr_decay_style: Optional[Literal["constant", "linear", "cosine"]] = None
    """Critic learning-rate schedule after warmup; null: ``train.lr_decay_style``."""
    tp: Optional[int] = Field(default=None, gt=0)
    """Tensor-parallel size of the critic; null: ``train.tp``. Another value than ``train.tp`` needs
    ``rl --launcher ray`` (the critic's own actor group)."""
    pp: Optional[int] = Field(default=None, gt=0)
    """Pipeline-parallel size of the critic; null: ``train.pp``. Another value than ``train.pp`` needs
    ``rl --launcher ray``."""
    dp: Optional[int] = Field(default=None, gt=0)
    """Data-parallel size of the critic; null: ``train.dp``. Under ``rl --launcher ray`` the critic group has
    ``critic.tp x critic.pp x critic.dp`` ranks (one Ray actor and one CPU or GPU each); elsewhere the critic
    runs on the trainer's ranks, so it must equal ``train.dp``."""
    value_clip: float = Field(default=algo_registry.DEFAULT_VALUE_CLIP, gt=0)
    """Value clip: the loss is ``max((V_old + clamp(V - V_old, -value_clip, value_clip) - G)^2, (V - G)^2)``."""
    num_critic_only_steps: int = Field(default=algo_registry.DEFAULT_NUM_CRITIC_ONLY_STEPS, ge=0)
    """The first this many rollouts train the critic only (the actor waits for useful values)."""
    num_steps_per_rollout: int = Field(default=1, ge=1)
    """Critic optimizer steps on each of the actor's global batches of a rollout (verl's critic ``ppo_epochs``):
    that many passes over the rollout's batches, every step's value clip relative to the rollout-time values
    ``V_old``. The critic's LR schedule counts these steps (its decay horizon is this many times the actor's)."""

    def resolved(self, train: "TrainSection") -> "CriticSection":
        """A copy with every null key replaced by the actor's value from ``train``."""
        inherit = {k: getattr(train, k) for k in ("lr", "min_lr", "lr_warmup_steps", "lr_decay_style", "tp", "pp",
                                                      "dp") if getattr(self, k) is None}
        return self.model_copy(update=inherit)


class SyncSection(Section):
    """Weight handoff from the trainer to the engines."""

    transport: Literal["disk", "distributed"] = "disk"
    """disk: engines load ``weights/N`` themselves; distributed: broadcast over a process group."""
    bucket_size_mb: int = Field(default=512, gt=0)
    """Distributed transport: most megabytes per broadcast bucket."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend for the distributed transport (auto: NCCL on GPU, gloo on CPU)."""
    master_addr: str = "127.0.0.1"
    """Distributed transport: this host's address as the engines reach it."""
    master_port: int = Field(default=0, ge=0, le=65535)
    """Distributed transport: port of the weight-update group (0 = a free port)."""
    verify: bool = False
    """After each sync read the weights back from every engine and compare them with the trainer's: every tensor by its xxh3-128 checksum where the engine gives them (the embedded engine), and a sample by value (SGLang's get_weights_by_name)."""
    pause_mode: Optional[Literal["abort", "retract", "in_place"]] = None
    """How engines pause for the update (SGLang's /pause_generation modes): ``abort`` ends the requests in
    flight; ``retract`` keeps them and recomputes their KV cache under the new weights; ``in_place`` keeps
    them and their old KV cache. Default: abort, or retract under ``rollout.async_mode = fully_async``."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Seconds a sync may take."""
    keep_weights: Optional[int] = Field(default=2, gt=0)
    """Published ``weights/N`` kept (older ones are deleted); null keeps all."""
    mode: Literal["full", "delta"] = "full"
    """full: every sync moves every weight; delta: ``weights/N`` also carries what changed since ``weights/N-1``,
    and engines that apply deltas (the embedded engine) and serve N-1 get only that; SGLang engines load a host-local
    copy the sync brings forward with it (``sync.local_copy``); others get the full weights.
    Pays in bf16 (an RL step changes ~1 % of the elements); in fp32 nearly every element moves and a delta is
    ~0.4x of the bytes, slower to apply (docs/benchmarks.md). Not for LoRA runs (their versions are small
    adapters)."""
    delta_encoding: Literal["xor", "overwrite"] = "xor"
    """sync.mode delta: xor of the old and new bit patterns (zeros where unchanged), or overwrite: the indices
    and new values of the changed elements."""
    delta_compression: Literal["zstd", "none"] = "zstd"
    """sync.mode delta: how each tensor's delta is compressed."""
    delta_level: int = Field(default=1, ge=1, le=22)
    """sync.mode delta: the zstd level (1: fastest)."""
    delta_checksum: Literal["xxh3_128"] = "xxh3_128"
    """sync.mode delta: the per-tensor checksum of the base and the result that every apply checks."""
    local_copy: bool = True
    """sync.mode delta, engines that cannot apply a delta (SGLang) on the sync's host: keep a full copy of the
    weights on this host's disk, bring it forward with each delta and have the engines load it, so only the delta
    is read from the run directory (slime's --update-weight-local-checkpoint-dir); false: they load the full
    ``weights/N``."""
    local_copy_dir: Optional[str] = None
    """Where the local copies live (one subdirectory per run, the last version only): an absolute path (``~``
    expanded) on host-local disk, not the shared filesystem; null: the host's temporary directory (``$TMPDIR`` or
    /tmp) + ``slimectl-weight-copies-<user>``."""

    @field_validator("local_copy_dir")
    @classmethod
    def _absolute_copy_dir(cls, value: Optional[str]) -> Optional[str]:
        import os

        if value is not None and not os.path.isabs(os.path.expanduser(value)):
            raise ValueError(f"{value!r} is relative; give an absolute path on this host's own disk (a relative "
                             f"one would land wherever the sync runs, often the shared filesystem)")
        return value


class LoggingSection(Section):
    """Console, TensorBoard and metrics.jsonl."""

    log_interval: int = Field(default=1, gt=0)
    """Not used yet: every optimizer step is logged and recorded."""
    tensorboard: bool = True
    """Also write TensorBoard event files under ``RUN/tensorboard/STAGE``."""
    progress: Literal["auto", "on", "off"] = "auto"
    """Progress bars on stderr (rollout, train, convert, export, sync, eval): auto shows them only when
    stderr is a terminal, and leaves the finished bar on screen."""
    wandb: bool = False
    """Also log every metric to Weights & Biases, under the same names as TensorBoard (one W&B run per
    stage, grouped by the run's name); needs ``pip install 'slimectl[wandb]'`` (without it: one warning)."""
    wandb_project: str = "slimectl"
    """W&B project of the runs."""
    wandb_entity: Optional[str] = None
    """W&B entity (user or team); null: W&B's default."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline writes the W&B runs under ``wandb_dir`` only (upload later with ``wandb sync``); online
    streams them to the W&B server (needs ``wandb login``)."""
    wandb_dir: str = "wandb"
    """Where W&B writes its files; a relative path is under the run directory."""


class SlimectlConfig(Section):
    """The whole resolved configuration of a run."""

    config_version: int = CONFIG_VERSION
    """Version of the config schema (this slimectl reads 1)."""
    name: Optional[str] = None
    """Free-form run name shown by ``slimectl status``."""
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    train: TrainSection = Field(default_factory=TrainSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    critic: CriticSection = Field(default_factory=CriticSection)
    sync: SyncSection = Field(default_factory=SyncSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)

    @model_validator(mode="after")
    def _check(self) -> "SlimectlConfig":
        if self.config_version != CONFIG_VERSION:
            raise ValueError(
                f"config_version {self.config_version} is not supported by this slimectl "
                f"(supports {CONFIG_VERSION})"
            )
        t, steps = self.train, self.rollout.num_rollout * self.train.num_steps_per_rollout
        if t.lr_decay_style != "constant" and t.lr_warmup_steps >= steps:
            raise ValueError(f"train.lr_warmup_steps ({t.lr_warmup_steps}) must be below the run's {steps} optimizer "
                             f"steps (rollout.num_rollout x train.num_steps_per_rollout) to decay the LR "
                             f"({t.lr_decay_style}); lower it or train longer")
        problem = critic_problem(self) or off_policy_problem(self) or lora_problem(self) or self._group_problem()
        if problem:
            raise ValueError(problem)
        if self.rollout.async_mode == "fully_async" and self.engine.offload_during_train:
            raise ValueError("engine.offload_during_train frees the engines while the trainer runs, but "
                             "rollout.async_mode = fully_async generates all the time; set one of them off")
        return self

    def _group_problem(self) -> str | None:
        """The first group a key names that ``engine.groups`` does not have, or a judge with nowhere to ask."""
        r, names = self.rollout, self.engine.group_names()
        for key, name in (("rollout.teacher_group", r.teacher_group), ("rollout.judge.group", r.judge.group)):
            if name is not None and name not in names:
                return (f"{key} = {name}: no engine group has that name (groups: {', '.join(names)}); add it to "
                        f"engine.groups or fix the name")
        if r.reward == "judge" and not (r.judge.group or r.judge.urls):
            return ("rollout.reward is judge but rollout.judge names no group and no urls; set rollout.judge.group "
                    "to a frozen group of engine.groups, or rollout.judge.urls")
        return None

    def group_config(self, name: str) -> "SlimectlConfig":
        """The config a frozen group's engines are started with: its ``engine`` section
        (:meth:`EngineSection.group_engine`), its model as ``model.path``, full weights (no LoRA)."""
        group = next(g for g in self.engine.frozen_groups if g.name == name)
        model = self.model.model_copy(update={"path": group.model or self.model.path, "adapter_path": None,
                                              "tokenizer_path": None if group.model else self.model.tokenizer_path})
        train = self.train.model_copy(update={"lora": None})
        return self.model_copy(update={"engine": self.engine.group_engine(group), "model": model, "train": train})

    @property
    def effective_max_staleness(self) -> int:
        """``rollout.max_staleness``, or what ``rollout.async_mode`` implies: 0 (off), 1 (one_step_off, fully_async)."""
        r = self.rollout
        if r.max_staleness is not None:
            return r.max_staleness
        return 0 if r.async_mode == "off" else 1

    @property
    def effective_stale_samples(self) -> str:
        """``rollout.stale_samples``, or drop under fully_async and keep otherwise."""
        r = self.rollout
        return r.stale_samples or ("drop" if r.async_mode == "fully_async" else "keep")

    @property
    def effective_pause_mode(self) -> str:
        """``sync.pause_mode``, or retract under fully_async (requests in flight go on) and abort otherwise."""
        return self.sync.pause_mode or ("retract" if self.rollout.async_mode == "fully_async" else "abort")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON form; equal configs have equal fingerprints."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


SECTIONS: tuple[str, ...] = ("model", "data", "rollout", "engine", "train", "algorithm", "critic", "sync", "logging")

#: Which sections each stage may override with ``--set`` (everything else comes frozen from
#: the run directory, so stages started separately agree on it).
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    "init": ("name",) + SECTIONS,
    "rl": ("name",) + SECTIONS,
    "serve": ("engine", "logging"),
    "rollout": ("data", "rollout", "engine", "logging"),
    "train": ("train", "algorithm", "critic", "logging"),
    "sync": ("sync", "engine", "logging"),
    "convert": ("model", "train", "logging"),
    "export": ("model", "logging"),
}
