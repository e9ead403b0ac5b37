"""The flag table of ``init --from-slime``: what each of slime's ``train.py`` flags becomes in slimectl.

One entry per flag: the dotted key(s) it sets and how its value converts, or why it is left out
(reported as "not needed by slimectl" or "not mapped"). The few flags whose keys depend on their
value or on another flag have a small rule of their own. Flags named by prefix (``--sglang-*``,
``--router-*``, ``--wandb-*``) come after the exact names; any other flag is "not mapped".
:class:`Translator` holds what the entries write: the config data and the report's lists.
:mod:`slimectl.stages.init.slime_launch` applies the table to a script's argv, then sets the GPU layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Callable

from slimectl.contract.errors import ConfigError

__all__ = ["FLAGS", "PREFIXES", "Flag", "Translator", "flag_spec", "one_value"]


class Translator:
    """The config data a script's flags build, and what the report will say; the flag table's rules
    write into it."""

    def __init__(self, schema: Any, seen: dict[str, list[str]]):
        self.schema = schema
        #: Each flag of the script with its (last) values.
        self.seen = seen
        self.data: dict[str, Any] = {}
        self.unmapped: list[tuple[str, str]] = []
        self.ignored: list[tuple[str, str]] = []
        self.notes: list[str] = []

    def has_key(self, dotted: str) -> bool:
        section, _, key = dotted.partition(".")
        fields = self.schema.model_fields
        if section not in fields:
            return False
        ann = fields[section].annotation
        return key in getattr(ann, "model_fields", {})

    def set(self, dotted: str, value: Any, flag: str | None = None) -> bool:
        if not self.has_key(dotted):
            if flag is not None:
                self.unmapped.append((flag, f"slimectl has no {dotted} yet"))
            return False
        section, _, key = dotted.partition(".")
        self.data.setdefault(section, {})[key] = value
        return True

    def get(self, dotted: str, default: Any = None) -> Any:
        section, _, key = dotted.partition(".")
        return self.data.get(section, {}).get(key, default)

    def int_flag(self, flag: str, default: Any) -> Any:
        """A layout flag's one integer value, ``default`` where the script does not pass it."""
        return int(one_value(flag, self.seen[flag])) if flag in self.seen else default


#: (flag, its values) -> the value its key(s) get.
Convert = Callable[[str, list[str]], Any]
#: (the translation so far, flag, its values): a flag's own rule.
Rule = Callable[[Translator, str, list[str]], None]


@dataclass(frozen=True)
class Flag:
    """What one slime flag becomes: keys set to its converted value, a reason it is left out, or a rule.

    ``late``: applied in a second pass over the argv, so reported after every flag without it.
    An entry with none of these (the layout's flags) does nothing here: the layout reads them."""

    keys: tuple[str, ...] = ()
    convert: Convert | None = None
    not_needed: str | None = None
    not_mapped: str | None = None
    rule: Rule | None = None
    late: bool = False

    def apply(self, t: Translator, flag: str, values: list[str]) -> None:
        if self.rule is not None:
            self.rule(t, flag, values)
        elif self.not_needed is not None:
            t.ignored.append((flag, self.not_needed))
        elif self.not_mapped is not None:
            t.unmapped.append((flag, self.not_mapped))
        elif self.keys and self.convert is not None:
            value = self.convert(flag, values)
            for dotted in self.keys:
                t.set(dotted, value, flag)


# --------------------------------------------------------------------------- values


def one_value(flag: str, values: list[str]) -> str:
    if len(values) != 1:
        raise ConfigError(f"slime flag {flag} takes one value, got {len(values)} ({' '.join(values) or 'none'}); "
                          "fix the launch script")
    return values[0]


def _number(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    return text


def _module_function(dotted: str) -> str:
    """slime's ``pkg.mod.fn`` -> slimectl's ``pkg.mod:fn``."""
    if ":" in dotted:
        return dotted
    mod, _, fn = dotted.rpartition(".")
    return f"{mod}:{fn}" if mod else dotted


def _checked(cast: Callable[[str], Any]) -> Convert:
    """One value through ``cast``; a bad one is a ConfigError naming the flag."""
    def convert(flag: str, values: list[str]) -> Any:
        raw = one_value(flag, values)
        try:
            return cast(raw)
        except ValueError:
            raise ConfigError(f"slime flag {flag} {raw!r}: not a {cast.__name__}; fix the launch script") from None
    return convert


def _unchecked(cast: Callable[[str], Any]) -> Convert:
    """One value through ``cast``; a bad one raises the cast's own ValueError, which does not name the
    flag (as these few flags always have: ``init`` reports an unexpected ValueError)."""
    return lambda flag, values: cast(one_value(flag, values))


def _constant(value: Any) -> Convert:
    return lambda flag, values: value


def _switch(flag: str, values: list[str]) -> bool:
    """store_true: bare is True; ``--flag false`` / ``0`` also read."""
    return True if not values else bool(_number(one_value(flag, values)))


def _words(flag: str, values: list[str]) -> list[str]:
    return list(values)


def _int_words(flag: str, values: list[str]) -> list[int]:
    return [int(v) for v in values]


def _name_path_pairs(flag: str, values: list[str]) -> dict[str, str]:
    if len(values) % 2:
        raise ConfigError(f"slime flag {flag} takes NAME PATH pairs, got {len(values)} value(s); "
                          "fix the launch script")
    return dict(zip(values[::2], values[1::2]))


def _json_object(flag: str, values: list[str]) -> dict[str, Any]:
    """A JSON object given as one value (slime's ``--multimodal-keys '{"image": "images"}'``)."""
    raw = one_value(flag, values)
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ConfigError(f"slime flag {flag} {raw!r}: not a JSON object; fix the launch script")
    return value


def _megabytes(flag: str, values: list[str]) -> int:
    return max(1, int(_number(one_value(flag, values))) // (1 << 20))


_text, _int, _float, _function = _checked(str), _checked(int), _checked(float), _checked(_module_function)


def _key(dotted: str, convert: Convert = _text) -> Flag:
    return Flag((dotted,), convert)


def _key_switch(dotted: str) -> Flag:
    return Flag((dotted,), _switch)


# --------------------------------------------------------------------------- the few rules

_PLUMBING_WHY = "Megatron/slime plumbing or performance setting that slimectl chooses itself"
_DEFAULT_ROLLOUT_FN = "slime.rollout.sglang_rollout.generate_rollout"
_NONZERO_STD = ("slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
                "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback")
_RM = {"math": "math", "deepscaler": "deepscaler", "dapo": "dapo", "f1": "f1", "gpqa": "gpqa",
       "remote_rm": "remote", "random": "random"}


def _rollout_function(t: Translator, flag: str, values: list[str]) -> None:
    if values and values[0] != _DEFAULT_ROLLOUT_FN:
        t.unmapped.append((flag, f"custom rollout function {values[0]}: port it as rollout.custom_generate "
                                 "(one sample) or run it behind `slimectl harness`"))
    else:
        t.ignored.append((flag, _PLUMBING_WHY))


def _data_source(t: Translator, flag: str, values: list[str]) -> None:
    if values and not values[0].startswith("slime."):
        t.unmapped.append((flag, f"custom data source {values[0]}: slimectl reads data.prompt_data "
                                 "(jsonl/parquet) itself"))
    else:
        t.ignored.append((flag, _PLUMBING_WHY))


def _recompute_granularity(t: Translator, flag: str, values: list[str]) -> None:
    granularity = one_value(flag, values)
    if granularity == "full":
        t.set("train.recompute", "full", flag)
    else:  # selective: Megatron's per-module recompute (core attention, MLP...)
        t.ignored.append((flag, f"{granularity!r} recompute: slimectl recomputes whole layers "
                                "(train.recompute: full) or nothing (none, kept)"))


def _reward_type(t: Translator, flag: str, values: list[str]) -> None:
    rm = one_value(flag, values)
    if rm in _RM:
        t.set("rollout.reward", _RM[rm], flag)
    else:
        t.unmapped.append((flag, f"rm_type {rm!r} has no slimectl reward; pick one of "
                                 f"{', '.join(sorted(set(_RM.values()) | {'last_number'}))} or a custom "
                                 "rollout.reward module:function (it stays at slimectl's default "
                                 f"{t.get('rollout.reward') or 'math'!r} until you do)"))


def _dynamic_filter(t: Translator, flag: str, values: list[str]) -> None:
    path = one_value(flag, values)
    if path in _NONZERO_STD:
        t.set("rollout.dynamic_filter", "nonzero_std", flag)
        if path.endswith("_with_fallback"):
            t.notes.append("--dynamic-sampling-filter-path ..._with_fallback: mapped to nonzero_std, which "
                           "samples more groups instead of keeping rejected ones")
    elif path.startswith("slime."):
        t.unmapped.append((flag, f"{path} is slime's own code; slimectl has rollout.dynamic_filter: nonzero_std"))
    else:
        t.set("rollout.dynamic_filter", _module_function(path), flag)


def _grpo_std_normalization(t: Translator, flag: str, values: list[str]) -> None:
    if "--disable-rewards-normalization" not in t.seen:
        t.set("algorithm.reward_normalization", "group_mean", flag)


def _weight_transport(t: Translator, flag: str, values: list[str]) -> None:
    transport = one_value(flag, values)
    t.set("sync.transport", "disk" if transport == "disk" else "distributed", flag)
    if transport == "nccl":
        t.set("sync.backend", "nccl", flag)


def _weight_mode(t: Translator, flag: str, values: list[str]) -> None:
    t.set("sync.mode", "delta" if one_value(flag, values) == "delta" else "full", flag)


def _delta_checksum(t: Translator, flag: str, values: list[str]) -> None:
    t.set("sync.delta_checksum", "xxh3_128", flag)
    if values and values[0].lower() not in ("xxh3", "xxh3_128", "xxh3-128", "true", "1"):
        t.notes.append(f"{flag} {values[0]}: slimectl checks every tensor of a delta with xxh3-128")


def _local_checkpoint_dir(t: Translator, flag: str, values: list[str]) -> None:
    t.set("sync.local_copy_dir", one_value(flag, values), flag)
    t.set("sync.local_copy", True, flag)
    t.notes.append(f"{flag}: each run's local copy is a subdirectory of it (the last version only); the embedded "
                   f"engine applies deltas in memory and needs none")


def _num_epoch(t: Translator, flag: str, values: list[str]) -> None:
    if "--num-rollout" not in t.seen:
        t.unmapped.append((flag, "needs the dataset's row count: set rollout.num_rollout = rows // "
                                 "rollout.batch_size x epochs"))


def _sglang_arg(t: Translator, flag: str, values: list[str]) -> None:
    """``--sglang-X V`` -> ``engine.sglang_args[X] = V`` (a number where it reads as one; bare: true)."""
    args = t.get("engine.sglang_args") or {}
    args[flag[len("--sglang-"):]] = _number(values[0]) if len(values) == 1 else (values or True)
    t.set("engine.sglang_args", args, flag)


def _mtp(t: Translator, flag: str, values: list[str]) -> None:
    """slime's MTP flags -> ``train.mtp``: ``--mtp-num-layers N`` trains N MTP layers with ``--enable-mtp-training``
    (without it slime builds them and never trains them, as slimectl carries them through);
    ``--mtp-loss-scaling-factor`` is the loss scale."""
    mtp = dict(t.get("train.mtp") or {})
    if flag == "--mtp-loss-scaling-factor":
        mtp["loss_scale"] = _float(flag, values)
    elif flag == "--mtp-num-layers" and "--enable-mtp-training" in t.seen:
        mtp["num_layers"] = _int(flag, values)
    elif flag == "--mtp-num-layers":
        t.ignored.append((flag, "without --enable-mtp-training the checkpoint's MTP layers are carried through, "
                                "not trained (train.mtp.num_layers 0)"))
        return
    elif "--mtp-num-layers" not in t.seen:  # --enable-mtp-training alone (slime asserts --mtp-num-layers)
        t.unmapped.append((flag, "needs --mtp-num-layers (train.mtp.num_layers: the model's MTP layers)"))
        return
    else:
        return  # --enable-mtp-training: --mtp-num-layers sets train.mtp.num_layers
    t.set("train.mtp", mtp, flag)


_HEALTH_CHECK = {"--use-fault-tolerance": "enabled", "--rollout-health-check-first-wait": "first_wait",
                 "--rollout-health-check-interval": "interval", "--rollout-health-check-timeout": "timeout"}


def _health_check(t: Translator, flag: str, values: list[str]) -> None:
    """slime's fault tolerance -> ``engine.health_check``: its switch, and the heartbeat's three timings."""
    key = _HEALTH_CHECK[flag]
    check = t.get("engine.health_check") or {}
    check[key] = True if key == "enabled" else _float(flag, values)
    t.set("engine.health_check", check, flag)


# --------------------------------------------------------------------------- the table

_ARCHITECTURE = (
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--group-query-attention",
    "--num-query-groups", "--kv-channels", "--rotary-base", "--rotary-percent", "--normalization",
    "--norm-epsilon", "--swiglu", "--disable-bias-linear", "--add-qkv-bias", "--untie-embeddings-and-output-weights",
    "--vocab-size", "--make-vocab-size-divisible-by", "--qk-layernorm", "--use-rotary-position-embeddings",
    "--position-embedding-type", "--seq-length", "--max-position-embeddings", "--use-rope-scaling",
    "--rotary-scaling-factor", "--num-experts", "--moe-ffn-hidden-size", "--moe-router-topk", "--model-name",
    "--moe-shared-expert-intermediate-size", "--moe-router-score-function", "--moe-layer-freq",
)
_BATCHING = ("--micro-batch-size", "--use-dynamic-batch-size", "--log-probs-max-tokens-per-gpu", "--balance-data",
             "--balance-by-flops", "--data-pad-size-multiplier")
_PLUMBING = (
    "--attention-dropout", "--hidden-dropout", "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32",
    "--attention-backend", "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
    "--use-precision-aware-optimizer", "--sequence-parallel", "--transformer-impl", "--no-gradient-accumulation-fusion",
    "--log-probs-chunk-size", "--distributed-timeout-minutes", "--train-backend",
    "--ckpt-format", "--no-load-optim", "--no-load-rng", "--finetune", "--no-save-optim", "--async-save",
    "--moe-token-dispatcher-type", "--moe-grouped-gemm", "--moe-permute-fusion", "--overlap-grad-reduce",
    "--overlap-param-gather", "--optimizer", "--num-gpus-per-node",
    "--calculate-per-token-loss-in-eval", "--loss-mask-type",
)
#: Read by the layout (slime_launch), after the table: trainer and engine GPUs, parallel sizes.
_LAYOUT = ("--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus", "--rollout-num-gpus-per-engine",
           "--context-parallel-size", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
           "--sglang-config")  # (its YAML: slime_sglang_config.py, after the layout)
_METRICS_WHY = "metrics go to RUN/metrics and TensorBoard under RUN/tensorboard"
_ROUTER_WHY = "slimectl's rollout balances requests over the engines itself (no router yet)"

#: Applied first: flags with one key, and two left out unless they name the user's own code.
_FIRST_PASS: dict[str, Flag] = {
    "--hf-checkpoint": _key("model.path"),
    "--prompt-data": _key("data.prompt_data"),
    "--input-key": _key("data.input_key"),
    "--label-key": _key("data.label_key"),
    "--metadata-key": _key("data.metadata_key"),
    "--tool-key": _key("data.tools_key"),
    "--multimodal-keys": _key("data.multimodal_keys", _json_object),
    "--rollout-max-prompt-len": _key("data.max_prompt_len", _int),
    "--apply-chat-template": _key_switch("data.apply_chat_template"),
    "--rollout-shuffle": _key_switch("data.shuffle"),
    "--num-rollout": _key("rollout.num_rollout", _int),
    "--rollout-batch-size": _key("rollout.batch_size", _int),
    "--n-samples-per-prompt": _key("rollout.n_samples_per_prompt", _int),
    "--over-sampling-batch-size": _key("rollout.over_sampling_batch_size", _int),
    "--rollout-temperature": _key("rollout.temperature", _float),
    "--rollout-top-p": _key("rollout.top_p", _float),
    "--rollout-top-k": _key("rollout.top_k", _int),
    "--rollout-max-response-len": _key("rollout.max_response_len", _int),
    "--reward-key": _key("rollout.reward_key"),
    "--rm-url": _key("rollout.remote_reward_url"),
    "--sglang-server-concurrency": _key("rollout.concurrency_per_engine", _int),
    "--custom-generate-function-path": _key("rollout.custom_generate", _function),
    "--partial-rollout": _key_switch("rollout.partial_rollout"),
    "--mask-offpolicy-in-partial-rollout": _key_switch("rollout.mask_offpolicy_in_partial_rollout"),
    "--group-rm": _key_switch("rollout.group_reward"),
    "--eval-interval": _key("rollout.eval_interval", _int),
    "--n-samples-per-eval-prompt": _key("rollout.eval_n_samples", _int),
    "--eval-temperature": _key("rollout.eval_temperature", _float),
    "--eval-max-response-len": _key("rollout.eval_max_response_len", _int),
    "--eval-top-p": _key("rollout.eval_top_p", _float),
    "--eval-reward-key": _key("rollout.eval_reward_key"),
    "--tensor-model-parallel-size": _key("train.tp", _int),
    "--pipeline-model-parallel-size": _key("train.pp", _int),
    "--moe-aux-loss-coeff": _key("train.moe_aux_loss_coeff", _float),
    "--lr": _key("train.lr", _float),
    "--min-lr": _key("train.min_lr", _float),
    "--lr-warmup-iters": _key("train.lr_warmup_steps", _int),
    "--lr-decay-style": _key("train.lr_decay_style"),
    "--weight-decay": _key("train.weight_decay", _float),
    "--adam-beta1": _key("train.adam_beta1", _float),
    "--adam-beta2": _key("train.adam_beta2", _float),
    "--adam-eps": _key("train.adam_eps", _float),
    "--clip-grad": _key("train.clip_grad", _float),
    "--global-batch-size": _key("train.global_batch_size", _int),
    "--num-steps-per-rollout": _key("train.num_steps_per_rollout", _int),
    "--max-tokens-per-gpu": _key("train.max_tokens_per_micro_batch", _int),
    "--recompute-method": _key("train.recompute_method"),
    "--recompute-num-layers": _key("train.recompute_num_layers", _int),
    "--save-interval": _key("train.save_interval", _int),
    "--seed": _key("train.seed", _int),
    "--use-rollout-logprobs": _key_switch("train.use_rollout_logprobs"),
    "--use-rollout-routing-replay": _key_switch("train.use_rollout_routing_replay"),
    "--mtp-num-layers": Flag(rule=_mtp),
    "--enable-mtp-training": Flag(rule=_mtp),
    "--mtp-loss-scaling-factor": Flag(rule=_mtp),
    "--use-distributed-optimizer": _key_switch("train.use_distributed_optimizer"),
    "--advantage-estimator": _key("algorithm.advantage_estimator"),
    "--loss-type": _key("algorithm.loss_type"),
    "--eps-clip": _key("algorithm.eps_clip", _float),
    "--eps-clip-high": _key("algorithm.eps_clip_high", _float),
    "--eps-clip-c": _key("algorithm.eps_clip_c", _float),
    "--entropy-coef": _key("algorithm.entropy_coef", _float),
    "--kl-loss-coef": _key("algorithm.kl_loss_coef", _float),
    "--kl-loss-type": _key("algorithm.kl_loss_type"),
    "--kl-coef": _key("algorithm.kl_coef", _float),
    "--gamma": _key("algorithm.gamma", _float),
    "--lambd": _key("algorithm.lambd", _float),
    "--tis-clip": _key("algorithm.tis_clip", _float),
    "--tis-clip-low": _key("algorithm.tis_clip_low", _float),
    "--opd-kl-coef": _key("algorithm.opd_kl_coef", _float),
    "--opsm-delta": _key("algorithm.opsm_delta", _float),
    "--ref-update-interval": _key("algorithm.ref_update_interval", _int),
    "--custom-loss-function-path": _key("algorithm.custom_loss_function", _function),
    "--custom-advantage-function-path": _key("algorithm.custom_advantage_function", _function),
    "--custom-pg-loss-reducer-function-path": _key("algorithm.custom_pg_loss_reducer", _function),
    "--custom-tis-function-path": _key("algorithm.custom_tis_function", _function),
    "--use-kl-loss": _key_switch("algorithm.use_kl_loss"),
    "--use-tis": _key_switch("algorithm.use_tis"),
    "--use-opd": _key_switch("algorithm.use_opd"),
    "--use-opsm": _key_switch("algorithm.use_opsm"),
    "--normalize-advantages": _key_switch("algorithm.normalize_advantages"),
    "--use-unbiased-kl": _key_switch("algorithm.use_unbiased_kl"),
    "--calculate-per-token-loss": _key_switch("algorithm.calculate_per_token_loss"),
    "--wandb-project": _key("logging.wandb_project"),
    "--wandb-group": _key("logging.wandb_group"),
    "--use-tensorboard": _key_switch("logging.tensorboard"),
    "--use-wandb": _key_switch("logging.wandb"),
    "--rollout-function-path": Flag(rule=_rollout_function),
    **{flag: Flag(rule=_health_check) for flag in _HEALTH_CHECK},
    "--data-source-path": Flag(rule=_data_source),
}

#: Applied second, so reported after every flag above (moving an entry between the passes reorders the
#: report): values with a conversion of their own, constants, the few rules, what RUN/ takes care of.
_SECOND_PASS: dict[str, Flag] = {
    "--bf16": _key("model.dtype", _constant("bf16")),
    "--fp16": _key("model.dtype", _constant("fp16")),
    "--eval-prompt-data": _key("data.eval_data", _name_path_pairs),
    "--rollout-seed": Flag(("data.seed", "rollout.seed"), _unchecked(int)),
    "--rollout-stop": _key("rollout.stop", _words),
    "--rollout-stop-token-ids": _key("rollout.stop_token_ids", _int_words),
    "--rm-type": Flag(rule=_reward_type),
    "--custom-rm-path": _key("rollout.reward", _function),
    "--dynamic-sampling-filter-path": Flag(rule=_dynamic_filter),
    "--recompute-granularity": Flag(rule=_recompute_granularity),
    "--disable-rewards-normalization": _key("algorithm.reward_normalization", _constant("none")),
    "--disable-grpo-std-normalization": Flag(rule=_grpo_std_normalization),
    "--colocate": _key("engine.offload_during_train", _constant(True)),  # also read by the layout
    "--offload": _key("engine.offload_during_train", _constant(True)),
    "--offload-rollout": _key("engine.offload_during_train", _constant(True)),
    "--offload-train": Flag(not_needed="the trainer runs in its own process; engine.offload_during_train frees "
                                       "the engine"),
    "--sglang-mem-fraction-static": _key("engine.mem_fraction_static", _unchecked(float)),
    "--update-weight-transport": Flag(rule=_weight_transport),
    "--update-weight-buffer-size": _key("sync.bucket_size_mb", _megabytes),
    "--update-weight-mode": Flag(rule=_weight_mode),
    "--update-weight-delta-encoding": _key("sync.delta_encoding"),
    "--update-weight-delta-checksum": Flag(rule=_delta_checksum),
    "--update-weight-local-checkpoint-dir": Flag(rule=_local_checkpoint_dir),
    "--num-epoch": Flag(rule=_num_epoch),
    "--ref-load": Flag(not_needed="the reference model is model.ref_path (an HF folder; default model.path), "
                                  "not a torch_dist checkpoint"),
    "--load": Flag(not_needed="slimectl resumes from RUN/checkpoints (rerun `slimectl rl -r RUN`); to start "
                              "from a Megatron checkpoint, `slimectl export --checkpoint` it to HF first"),
    "--save": Flag(not_needed="checkpoints go to RUN/checkpoints, exports to RUN/exports"),
    "--use-slime-router": Flag(not_mapped=_ROUTER_WHY),
    "--tensorboard-dir": Flag(not_needed=_METRICS_WHY),
}


def _one_entry_each(*passes: tuple[dict[str, Flag], ...]) -> dict[str, Flag]:
    """The passes' groups as one table (the second pass's entries marked ``late``); a flag listed
    twice is a mistake in the table."""
    table: dict[str, Flag] = {}
    for late, groups in enumerate(passes):
        for group in groups:
            for flag, spec in group.items():
                if flag in table:
                    raise AssertionError(f"slime flag {flag} is in the flag table twice")
                table[flag] = replace(spec, late=bool(late))
    return table


#: Every slime flag slimectl knows by name. The second pass's flags are applied after the first's.
FLAGS: dict[str, Flag] = _one_entry_each(
    (_FIRST_PASS,
     dict.fromkeys(_ARCHITECTURE, Flag(not_needed="model architecture: slimectl reads it from model.path's "
                                                  "config.json")),
     dict.fromkeys(_BATCHING, Flag(not_needed="slimectl packs micro-batches up to "
                                              "train.max_tokens_per_micro_batch tokens")),
     dict.fromkeys(_PLUMBING, Flag(not_needed=_PLUMBING_WHY))),
    (_SECOND_PASS,
     dict.fromkeys(_LAYOUT, Flag())),
)
#: Flags known by prefix, tried in order after the exact names.
PREFIXES: tuple[tuple[str, Flag], ...] = (
    ("--sglang-", Flag(rule=_sglang_arg, late=True)),
    ("--router-", Flag(not_mapped=_ROUTER_WHY, late=True)),
    ("--wandb-", Flag(not_needed=_METRICS_WHY, late=True)),
)
_UNKNOWN = Flag(not_mapped="no slimectl equivalent", late=True)


def flag_spec(flag: str) -> Flag:
    """The table's entry for ``flag``: by name, else by prefix, else "no slimectl equivalent"."""
    if flag in FLAGS:
        return FLAGS[flag]
    return next((spec for prefix, spec in PREFIXES if flag.startswith(prefix)), _UNKNOWN)
