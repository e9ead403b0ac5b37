"""Translate a slime launch script (``train.py``/``train_async.py`` flags) into a slimectl config.

``slimectl init RUN --from-slime run-qwen3-4B.sh`` reads the bash script a slime user already has:
its array and scalar variables (``ROLLOUT_ARGS=( --rollout-batch-size 32 ... )``, ``MODEL=/root/x``),
``source``d model files it can find, and the ``python3 train.py ${ROLLOUT_ARGS[@]} ...`` line (also
behind ``ray job submit ... --``). Each flag maps to a slimectl key (``rollout.batch_size``), is
dropped on purpose with the reason (model architecture comes from ``model.path``'s config.json;
Megatron performance knobs), or is listed as not mapped with why. Where slime's default differs from
slimectl's (``kl_loss_type: k1``, no chat template, no shuffle, one sample per prompt, Megatron's
Adam betas and weight decay), the slime default is written, so the run trains what slime would.

The bash is read, never run, by :mod:`slimectl.contract.slime_script`; flags whose value needs a
``$(...)`` command substitution are reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from slimectl.contract.errors import ConfigError
from slimectl.contract.slime_script import parse_launch_script

__all__ = ["SlimeTranslation", "parse_launch_script", "translate_slime_args", "translate_slime_script"]


@dataclass
class SlimeTranslation:
    """What a launch script becomes: config data, plus what was left out and why."""

    data: dict[str, Any]
    #: (flag, why it was not mapped) for every flag with no slimectl equivalent.
    unmapped: list[tuple[str, str]] = field(default_factory=list)
    #: (flag, why slimectl needs no equivalent) for flags dropped on purpose.
    ignored: list[tuple[str, str]] = field(default_factory=list)
    #: Things the user should know (defaults taken from slime, choices made for them).
    notes: list[str] = field(default_factory=list)
    script: str = ""

    def report(self) -> str:
        """Human-readable lines: what was not mapped, what was dropped on purpose, the notes."""
        lines = []
        if self.unmapped:
            lines.append(f"{len(self.unmapped)} slime flag(s) not mapped:")
            lines += [f"  {flag}: {why}" for flag, why in self.unmapped]
        if self.ignored:
            lines.append(f"{len(self.ignored)} slime flag(s) not needed by slimectl:")
            lines += [f"  {flag}: {why}" for flag, why in self.ignored]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


# --------------------------------------------------------------------------- flags -> keys


def _group_flags(argv: list[str]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    flags: list[tuple[str, list[str]]] = []
    stray: list[str] = []
    for word in argv:
        if word.startswith("--") and len(word) > 2:
            name, eq, value = word.partition("=")
            flags.append((name, [value] if eq else []))
        elif flags:
            flags[-1][1].append(word)
        else:
            stray.append(word)
    return flags, stray


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


#: Model architecture flags (scripts/models/*.sh): slimectl reads them from the HF config.json.
_ARCH = {
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--group-query-attention",
    "--num-query-groups", "--kv-channels", "--rotary-base", "--rotary-percent", "--normalization",
    "--norm-epsilon", "--swiglu", "--disable-bias-linear", "--add-qkv-bias", "--untie-embeddings-and-output-weights",
    "--vocab-size", "--make-vocab-size-divisible-by", "--qk-layernorm", "--use-rotary-position-embeddings",
    "--position-embedding-type", "--seq-length", "--max-position-embeddings", "--use-rope-scaling",
    "--rotary-scaling-factor", "--num-experts", "--moe-ffn-hidden-size", "--moe-router-topk", "--model-name",
    "--moe-shared-expert-intermediate-size", "--moe-router-score-function", "--moe-layer-freq",
}
_ARCH_WHY = "model architecture: slimectl reads it from model.path's config.json"

#: Megatron/slime performance and plumbing knobs that slimectl sets itself.
_PERF = {
    "--attention-dropout",
    "--hidden-dropout", "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32",
    "--attention-backend", "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
    "--use-precision-aware-optimizer", "--micro-batch-size", "--use-dynamic-batch-size",
    "--log-probs-max-tokens-per-gpu", "--sequence-parallel", "--transformer-impl", "--no-gradient-accumulation-fusion",
    "--data-pad-size-multiplier", "--log-probs-chunk-size", "--distributed-timeout-minutes", "--train-backend",
    "--ckpt-format", "--no-load-optim", "--no-load-rng", "--finetune", "--no-save-optim", "--async-save",
    "--moe-token-dispatcher-type", "--moe-grouped-gemm", "--moe-permute-fusion", "--overlap-grad-reduce",
    "--overlap-param-gather", "--balance-data", "--balance-by-flops", "--update-weight-mode", "--optimizer",
    "--rollout-function-path", "--data-source-path", "--num-gpus-per-node", "--use-fault-tolerance",
    "--calculate-per-token-loss-in-eval", "--loss-mask-type", "--rollout-health-check-interval",
    "--rollout-health-check-timeout", "--rollout-health-check-first-wait",
}
_PERF_WHY = "Megatron/slime plumbing or performance setting that slimectl chooses itself"
_BATCHING = {"--micro-batch-size", "--use-dynamic-batch-size", "--log-probs-max-tokens-per-gpu", "--balance-data",
             "--balance-by-flops", "--data-pad-size-multiplier"}
_BATCHING_WHY = "slimectl packs micro-batches up to train.max_tokens_per_micro_batch tokens"

_DEFAULT_ROLLOUT_FN = "slime.rollout.sglang_rollout.generate_rollout"
_NONZERO_STD = ("slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
                "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback")
_RM = {"math": "math", "deepscaler": "deepscaler", "dapo": "dapo", "f1": "f1", "gpqa": "gpqa",
       "remote_rm": "remote", "random": "random"}

#: Where slime's default differs from slimectl's, the slime default (written first, flags win).
SLIME_DEFAULTS: dict[str, Any] = {
    "data.apply_chat_template": False,   # --apply-chat-template is opt-in in slime
    "data.shuffle": False,               # --rollout-shuffle is opt-in
    "data.label_key": None,              # --label-key has no default
    "rollout.n_samples_per_prompt": 1,
    "rollout.eval_n_samples": 1,         # --n-samples-per-eval-prompt
    "algorithm.kl_loss_type": "k1",
    "train.adam_beta2": 0.999,           # Megatron's defaults (slimectl: 0.98, 0.0, constant)
    "train.weight_decay": 0.01,
    "train.lr_decay_style": "linear",
    "engine.backend": "sglang",          # slime always serves with SGLang
}


class _Translator:
    def __init__(self, schema: Any):
        self.schema = schema
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


def _one(flag: str, values: list[str]) -> str:
    if len(values) != 1:
        raise ConfigError(f"slime flag {flag} takes one value, got {len(values)} ({' '.join(values) or 'none'}); "
                          "fix the launch script")
    return values[0]


def translate_slime_args(argv: list[str], script_name: str = "train.py") -> SlimeTranslation:
    """Map slime's ``train.py`` argv to slimectl config data (not yet validated)."""
    from slimectl.contract.config_schema import SlimectlConfig

    t = _Translator(SlimectlConfig)
    for dotted, value in SLIME_DEFAULTS.items():
        t.set(dotted, value)
    if script_name == "train_async.py":
        t.set("rollout.async_mode", "one_step_off")
        t.notes.append("train_async.py: rollout.async_mode = one_step_off (one rollout ahead of training)")

    flags, stray = _group_flags(argv)
    for word in stray:
        t.unmapped.append((word, "not a --flag; left out"))
    seen: dict[str, list[str]] = {}
    for flag, values in flags:
        seen[flag] = values

    def boolean(flag: str, values: list[str]) -> bool:
        return True if not values else bool(_number(_one(flag, values)))

    direct: dict[str, tuple[str, Callable[[str], Any]]] = {
        "--hf-checkpoint": ("model.path", str),
        "--prompt-data": ("data.prompt_data", str),
        "--input-key": ("data.input_key", str),
        "--label-key": ("data.label_key", str),
        "--metadata-key": ("data.metadata_key", str),
        "--tool-key": ("data.tools_key", str),
        "--rollout-max-prompt-len": ("data.max_prompt_len", int),
        "--num-rollout": ("rollout.num_rollout", int),
        "--rollout-batch-size": ("rollout.batch_size", int),
        "--n-samples-per-prompt": ("rollout.n_samples_per_prompt", int),
        "--over-sampling-batch-size": ("rollout.over_sampling_batch_size", int),
        "--rollout-temperature": ("rollout.temperature", float),
        "--rollout-top-p": ("rollout.top_p", float),
        "--rollout-top-k": ("rollout.top_k", int),
        "--rollout-max-response-len": ("rollout.max_response_len", int),
        "--reward-key": ("rollout.reward_key", str),
        "--rm-url": ("rollout.remote_reward_url", str),
        "--sglang-server-concurrency": ("rollout.concurrency_per_engine", int),
        "--eval-interval": ("rollout.eval_interval", int),
        "--n-samples-per-eval-prompt": ("rollout.eval_n_samples", int),
        "--eval-temperature": ("rollout.eval_temperature", float),
        "--eval-max-response-len": ("rollout.eval_max_response_len", int),
        "--eval-top-p": ("rollout.eval_top_p", float),
        "--eval-reward-key": ("rollout.eval_reward_key", str),
        "--tensor-model-parallel-size": ("train.tp", int),
        "--pipeline-model-parallel-size": ("train.pp", int),
        "--moe-aux-loss-coeff": ("train.moe_aux_loss_coeff", float),
        "--lr": ("train.lr", float),
        "--min-lr": ("train.min_lr", float),
        "--lr-warmup-iters": ("train.lr_warmup_steps", int),
        "--lr-decay-style": ("train.lr_decay_style", str),
        "--weight-decay": ("train.weight_decay", float),
        "--adam-beta1": ("train.adam_beta1", float),
        "--adam-beta2": ("train.adam_beta2", float),
        "--adam-eps": ("train.adam_eps", float),
        "--clip-grad": ("train.clip_grad", float),
        "--global-batch-size": ("train.global_batch_size", int),
        "--num-steps-per-rollout": ("train.num_steps_per_rollout", int),
        "--max-tokens-per-gpu": ("train.max_tokens_per_micro_batch", int),
        "--recompute-method": ("train.recompute_method", str),
        "--recompute-num-layers": ("train.recompute_num_layers", int),
        "--save-interval": ("train.save_interval", int),
        "--seed": ("train.seed", int),
        "--advantage-estimator": ("algorithm.advantage_estimator", str),
        "--loss-type": ("algorithm.loss_type", str),
        "--eps-clip": ("algorithm.eps_clip", float),
        "--eps-clip-high": ("algorithm.eps_clip_high", float),
        "--eps-clip-c": ("algorithm.eps_clip_c", float),
        "--entropy-coef": ("algorithm.entropy_coef", float),
        "--kl-loss-coef": ("algorithm.kl_loss_coef", float),
        "--kl-loss-type": ("algorithm.kl_loss_type", str),
        "--kl-coef": ("algorithm.kl_coef", float),
        "--gamma": ("algorithm.gamma", float),
        "--lambd": ("algorithm.lambd", float),
        "--tis-clip": ("algorithm.tis_clip", float),
        "--tis-clip-low": ("algorithm.tis_clip_low", float),
        "--opd-kl-coef": ("algorithm.opd_kl_coef", float),
        "--opsm-delta": ("algorithm.opsm_delta", float),
        "--ref-update-interval": ("algorithm.ref_update_interval", int),
        "--custom-loss-function-path": ("algorithm.custom_loss_function", _module_function),
        "--custom-advantage-function-path": ("algorithm.custom_advantage_function", _module_function),
        "--custom-pg-loss-reducer-function-path": ("algorithm.custom_pg_loss_reducer", _module_function),
        "--custom-tis-function-path": ("algorithm.custom_tis_function", _module_function),
        "--custom-generate-function-path": ("rollout.custom_generate", _module_function),
        "--wandb-project": ("logging.wandb_project", str),
        "--wandb-group": ("logging.wandb_group", str),
    }
    switches: dict[str, str] = {
        "--apply-chat-template": "data.apply_chat_template",
        "--rollout-shuffle": "data.shuffle",
        "--partial-rollout": "rollout.partial_rollout",
        "--mask-offpolicy-in-partial-rollout": "rollout.mask_offpolicy_in_partial_rollout",
        "--group-rm": "rollout.group_reward",
        "--use-kl-loss": "algorithm.use_kl_loss",
        "--use-tis": "algorithm.use_tis",
        "--use-opd": "algorithm.use_opd",
        "--use-opsm": "algorithm.use_opsm",
        "--normalize-advantages": "algorithm.normalize_advantages",
        "--use-unbiased-kl": "algorithm.use_unbiased_kl",
        "--calculate-per-token-loss": "algorithm.calculate_per_token_loss",
        "--use-rollout-logprobs": "train.use_rollout_logprobs",
        "--use-rollout-routing-replay": "train.use_rollout_routing_replay",
        "--use-distributed-optimizer": "train.use_distributed_optimizer",
        "--use-tensorboard": "logging.tensorboard",
        "--use-wandb": "logging.wandb",
    }

    for flag, values in flags:
        if flag in direct:
            key, cast = direct[flag]
            raw = _one(flag, values)
            try:
                value = cast(raw)
            except ValueError:
                raise ConfigError(f"slime flag {flag} {raw!r}: not a {cast.__name__}; fix the launch script") from None
            t.set(key, value, flag)
        elif flag in switches:
            t.set(switches[flag], boolean(flag, values), flag)
        elif flag in _ARCH:
            t.ignored.append((flag, _ARCH_WHY))
        elif flag in _PERF:
            if flag == "--rollout-function-path" and values and values[0] != _DEFAULT_ROLLOUT_FN:
                t.unmapped.append((flag, f"custom rollout function {values[0]}: port it as rollout.custom_generate "
                                         "(one sample) or run it behind `slimectl harness`"))
            elif flag == "--data-source-path" and values and not values[0].startswith("slime."):
                t.unmapped.append((flag, f"custom data source {values[0]}: slimectl reads data.prompt_data "
                                         "(jsonl/parquet) itself"))
            else:
                t.ignored.append((flag, _BATCHING_WHY if flag in _BATCHING else _PERF_WHY))

    # ---- flags that need a rule of their own
    for flag, values in flags:
        if flag in direct or flag in switches or flag in _ARCH or flag in _PERF:
            continue
        if flag == "--rollout-seed":
            seed = int(_one(flag, values))
            t.set("data.seed", seed)
            t.set("rollout.seed", seed)
        elif flag == "--recompute-granularity":
            granularity = _one(flag, values)
            if granularity == "full":
                t.set("train.recompute", "full", flag)
            else:  # selective: Megatron's per-module recompute (core attention, MLP...)
                t.ignored.append((flag, f"{granularity!r} recompute: slimectl recomputes whole layers "
                                        "(train.recompute: full) or nothing (none, kept)"))
        elif flag == "--rollout-stop":
            t.set("rollout.stop", list(values), flag)
        elif flag == "--rollout-stop-token-ids":
            t.set("rollout.stop_token_ids", [int(v) for v in values], flag)
        elif flag == "--rm-type":
            rm = _one(flag, values)
            if rm in _RM:
                t.set("rollout.reward", _RM[rm])
            else:
                t.unmapped.append((flag, f"rm_type {rm!r} has no slimectl reward; pick one of "
                                         f"{', '.join(sorted(set(_RM.values()) | {'last_number'}))} or a custom "
                                         "rollout.reward module:function (it stays at slimectl's default "
                                         f"{t.get('rollout.reward') or 'math'!r} until you do)"))
        elif flag == "--custom-rm-path":
            t.set("rollout.reward", _module_function(_one(flag, values)))
        elif flag == "--dynamic-sampling-filter-path":
            path = _one(flag, values)
            if path in _NONZERO_STD:
                t.set("rollout.dynamic_filter", "nonzero_std")
                if path.endswith("_with_fallback"):
                    t.notes.append("--dynamic-sampling-filter-path ..._with_fallback: mapped to nonzero_std, which "
                                   "samples more groups instead of keeping rejected ones")
            elif path.startswith("slime."):
                t.unmapped.append((flag, f"{path} is slime's own code; slimectl has rollout.dynamic_filter: nonzero_std"))
            else:
                t.set("rollout.dynamic_filter", _module_function(path))
        elif flag == "--eval-prompt-data":
            if len(values) % 2:
                raise ConfigError(f"slime flag {flag} takes NAME PATH pairs, got {len(values)} value(s); "
                                  "fix the launch script")
            t.set("data.eval_data", dict(zip(values[::2], values[1::2])), flag)
        elif flag == "--disable-rewards-normalization":
            t.set("algorithm.reward_normalization", "none", flag)
        elif flag == "--disable-grpo-std-normalization":
            if "--disable-rewards-normalization" not in seen:
                t.set("algorithm.reward_normalization", "group_mean", flag)
        elif flag in ("--bf16", "--fp16"):
            t.set("model.dtype", flag[2:])
        elif flag in ("--colocate", "--offload", "--offload-rollout"):
            t.set("engine.offload_during_train", True)
        elif flag == "--offload-train":
            t.ignored.append((flag, "the trainer runs in its own process; engine.offload_during_train frees the engine"))
        elif flag == "--update-weight-transport":
            v = _one(flag, values)
            t.set("sync.transport", "disk" if v == "disk" else "distributed")
            if v == "nccl":
                t.set("sync.backend", "nccl")
        elif flag == "--update-weight-buffer-size":
            t.set("sync.bucket_size_mb", max(1, int(_number(_one(flag, values))) // (1 << 20)))
        elif flag == "--num-epoch":
            if "--num-rollout" not in seen:
                t.unmapped.append((flag, "needs the dataset's row count: set rollout.num_rollout = rows // "
                                         "rollout.batch_size x epochs"))
        elif flag == "--ref-load":
            t.ignored.append((flag, "the reference model is model.ref_path (an HF folder; default model.path), "
                                    "not a torch_dist checkpoint"))
        elif flag == "--load":
            t.ignored.append((flag, "slimectl resumes from RUN/checkpoints (rerun `slimectl rl -r RUN`); to start "
                                    "from a Megatron checkpoint, `slimectl export --checkpoint` it to HF first"))
        elif flag == "--save":
            t.ignored.append((flag, "checkpoints go to RUN/checkpoints, exports to RUN/exports"))
        elif flag in ("--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus",
                      "--rollout-num-gpus-per-engine", "--context-parallel-size", "--expert-model-parallel-size",
                      "--expert-tensor-parallel-size"):
            pass  # the layout, below
        elif flag == "--sglang-mem-fraction-static":
            t.set("engine.mem_fraction_static", float(_one(flag, values)))
        elif flag.startswith("--sglang-"):
            args = t.get("engine.sglang_args") or {}
            args[flag[len("--sglang-"):]] = _number(values[0]) if len(values) == 1 else (values or True)
            t.set("engine.sglang_args", args)
        elif flag.startswith("--router-") or flag in ("--use-slime-router", "--sglang-router-ip", "--sglang-router-port"):
            t.unmapped.append((flag, "slimectl's rollout balances requests over the engines itself (no router yet)"))
        elif flag.startswith("--wandb-") or flag in ("--tensorboard-dir", "--use-wandb"):
            t.ignored.append((flag, "metrics go to RUN/metrics and TensorBoard under RUN/tensorboard"))
        else:
            t.unmapped.append((flag, "no slimectl equivalent"))

    # ---- flags slime reads only together with another one (slimectl refuses them alone)
    a = t.data.get("algorithm", {})
    if a.get("custom_loss_function") and a.get("loss_type") != "custom_loss":
        del a["custom_loss_function"]
        t.ignored.append(("--custom-loss-function-path", "slime calls it only with --loss-type custom_loss"))
    if a.get("custom_tis_function") and not a.get("use_tis"):
        del a["custom_tis_function"]
        t.ignored.append(("--custom-tis-function-path", "slime calls it only with --use-tis"))
    from slimectl.contract.algorithm_names import GROUP_ESTIMATORS

    if a.get("kl_coef") and a.get("advantage_estimator", "grpo") in GROUP_ESTIMATORS:
        del a["kl_coef"]
        t.ignored.append(("--kl-coef", f"the {a.get('advantage_estimator', 'grpo')} advantages do not use the KL "
                                       "reward penalty (use --kl-loss-coef)"))

    # ---- the GPU layout
    nodes = int(_one("--actor-num-nodes", seen["--actor-num-nodes"])) if "--actor-num-nodes" in seen else 1
    per_node = (int(_one("--actor-num-gpus-per-node", seen["--actor-num-gpus-per-node"]))
                if "--actor-num-gpus-per-node" in seen else 8)
    world = nodes * per_node
    tp, pp = int(t.get("train.tp", 1)), int(t.get("train.pp", 1))
    for flag, why in (("--context-parallel-size", "slimectl trains with TP, PP, DP and EP (context parallelism: not yet)"),
                      ("--expert-tensor-parallel-size", "slimectl's experts are split like the dense layers (expert TP = "
                                                        "train.tp); a separate expert TP size is not supported")):
        if flag in seen and int(_one(flag, seen[flag])) != 1:
            t.unmapped.append((flag, why))
    if world % (tp * pp):
        t.unmapped.append(("--actor-num-gpus-per-node", f"{world} trainer GPUs are not a multiple of TP x PP = "
                                                        f"{tp * pp}; train.dp left at 1"))
    else:
        t.set("train.dp", world // (tp * pp))
    if "--expert-model-parallel-size" in seen:
        ep = int(_one("--expert-model-parallel-size", seen["--expert-model-parallel-size"]))
        dp = int(t.get("train.dp", 1))
        if ep != 1 and dp % ep:
            t.unmapped.append(("--expert-model-parallel-size", f"EP {ep} must divide the {dp} data-parallel ranks "
                                                               f"(megatron-core: expert ranks are data-parallel ranks); "
                                                               f"train.ep left at 1"))
        elif ep != 1:
            t.set("train.ep", ep, "--expert-model-parallel-size")
    per_engine = int(_one("--rollout-num-gpus-per-engine", seen["--rollout-num-gpus-per-engine"])) \
        if "--rollout-num-gpus-per-engine" in seen else 1
    colocate = "--colocate" in seen
    rollout_gpus = (int(_one("--rollout-num-gpus", seen["--rollout-num-gpus"]))
                    if "--rollout-num-gpus" in seen else (world if colocate else None))
    t.set("engine.tp_size", per_engine)
    if rollout_gpus is None:
        t.notes.append("no --rollout-num-gpus: engine.num_engines left at 1")
    elif rollout_gpus % per_engine:
        t.unmapped.append(("--rollout-num-gpus", f"{rollout_gpus} GPUs do not split into engines of {per_engine}"))
    else:
        t.set("engine.num_engines", max(1, rollout_gpus // per_engine))
    if colocate and "--update-weight-transport" not in seen:
        t.set("sync.transport", "disk")
        t.notes.append("--colocate: slime hands weights over in GPU memory; slimectl syncs colocated engines "
                       "through disk (sync.transport: disk)")
    elif not colocate and "--update-weight-transport" not in seen:
        t.set("sync.transport", "distributed")
    if "--rollout-max-response-len" not in seen:
        t.notes.append("no --rollout-max-response-len (slime generates up to the context length): "
                       "rollout.max_response_len keeps slimectl's default; set it")
    if "--hf-checkpoint" not in seen:
        t.notes.append("no --hf-checkpoint: set model.path to the HF model folder")
    if world > 1 or per_engine > 1:
        t.notes.append(f"the layout asks for {world} trainer GPU(s) (train.dp = {t.get('train.dp', 1)}) and engines "
                       f"of {per_engine}; on a CPU machine use --set train.dp=1 --set engine.backend=embedded")
    return SlimeTranslation(t.data, t.unmapped, t.ignored, t.notes)


def translate_slime_script(path: str | Path) -> SlimeTranslation:
    """Read a slime launch script and translate its ``train.py`` flags (see the module docstring)."""
    argv, script_name, notes = parse_launch_script(path)
    out = translate_slime_args(argv, script_name)
    out.notes = notes + out.notes
    out.script = str(path)
    return out
