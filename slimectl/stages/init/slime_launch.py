"""Translate a slime launch script (``train.py``/``train_async.py`` flags) into a slimectl config.

``slimectl init RUN --from-slime run-qwen3-4B.sh`` reads the bash script a slime user already has:
its array and scalar variables (``ROLLOUT_ARGS=( --rollout-batch-size 32 ... )``, ``MODEL=/root/x``),
``source``d model files it can find, and the ``python3 train.py ${ROLLOUT_ARGS[@]} ...`` line (also
behind ``ray job submit ... --``). Each flag, by the flag table of :mod:`slimectl.stages.init.slime_flags`,
maps to a slimectl key (``rollout.batch_size``), is dropped on purpose with the reason (model
architecture comes from ``model.path``'s config.json; Megatron performance knobs), or is listed as
not mapped with why; the GPU layout flags then set ``train.dp``/``ep`` and the engines. Where slime's default differs from
slimectl's (``kl_loss_type: k1``, no chat template, no shuffle, one sample per prompt, Megatron's
Adam betas and weight decay), the slime default is written, so the run trains what slime would.

The bash is read, never run, by :mod:`slimectl.stages.init.slime_script`; flags whose value needs a
``$(...)`` command substitution are reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slimectl.stages.init.slime_flags import Translator, flag_spec, one_value
from slimectl.stages.init.slime_script import parse_launch_script

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


def translate_slime_args(argv: list[str], script_name: str = "train.py", base: Path | None = None) -> SlimeTranslation:
    """Map slime's ``train.py`` argv to slimectl config data (not yet validated): the slime defaults,
    then each flag by :data:`slimectl.stages.init.slime_flags.FLAGS`, then the GPU layout, then the engine groups
    of ``--sglang-config`` (a relative path: against ``base``, the script's folder, when it is there)."""
    from slimectl.contract.config_schema import SlimectlConfig

    flags, stray = _group_flags(argv)
    t = Translator(SlimectlConfig, seen=dict(flags))
    for dotted, value in SLIME_DEFAULTS.items():
        t.set(dotted, value)
    if script_name == "train_async.py":
        t.set("rollout.async_mode", "one_step_off")
        t.notes.append("train_async.py: rollout.async_mode = one_step_off (one rollout ahead of training)")
    for word in stray:
        t.unmapped.append((word, "not a --flag; left out"))
    for late in (False, True):
        for flag, values in flags:
            spec = flag_spec(flag)
            if spec.late is late:
                spec.apply(t, flag, values)
    _drop_flags_slime_reads_only_with_another(t)
    world = _trainer_layout(t)
    per_engine = _engine_layout(t, world)
    if "--sglang-config" in t.seen:
        _engine_groups(t, per_engine, base)
    _closing_notes(t, world, per_engine)
    return SlimeTranslation(t.data, t.unmapped, t.ignored, t.notes)


def _drop_flags_slime_reads_only_with_another(t: Translator) -> None:
    """What slimectl would refuse alone, slime never reads alone: dropped with the reason."""
    from slimectl.contract.algorithm_names import GROUP_ESTIMATORS

    a = t.data.get("algorithm", {})
    if a.get("custom_loss_function") and a.get("loss_type") != "custom_loss":
        del a["custom_loss_function"]
        t.ignored.append(("--custom-loss-function-path", "slime calls it only with --loss-type custom_loss"))
    if a.get("custom_tis_function") and not a.get("use_tis"):
        del a["custom_tis_function"]
        t.ignored.append(("--custom-tis-function-path", "slime calls it only with --use-tis"))
    if a.get("kl_coef") and a.get("advantage_estimator", "grpo") in GROUP_ESTIMATORS:
        del a["kl_coef"]
        t.ignored.append(("--kl-coef", f"the {a.get('advantage_estimator', 'grpo')} advantages do not use the KL "
                                       "reward penalty (use --kl-loss-coef)"))


def _trainer_layout(t: Translator) -> int:
    """train.dp (and train.ep) from the trainer's GPUs and TP x PP; returns the trainer's GPU count."""
    world = t.int_flag("--actor-num-nodes", 1) * t.int_flag("--actor-num-gpus-per-node", 8)
    tp, pp = int(t.get("train.tp", 1)), int(t.get("train.pp", 1))
    for flag, why in (("--context-parallel-size", "slimectl trains with TP, PP, DP and EP (context parallelism: not yet)"),
                      ("--expert-tensor-parallel-size", "slimectl's experts are split like the dense layers (expert TP = "
                                                        "train.tp); a separate expert TP size is not supported")):
        if t.int_flag(flag, 1) != 1:
            t.unmapped.append((flag, why))
    if world % (tp * pp):
        t.unmapped.append(("--actor-num-gpus-per-node", f"{world} trainer GPUs are not a multiple of TP x PP = "
                                                        f"{tp * pp}; train.dp left at 1"))
    else:
        t.set("train.dp", world // (tp * pp))
    ep = t.int_flag("--expert-model-parallel-size", 1)
    dp = int(t.get("train.dp", 1))
    if ep != 1 and dp % ep:
        t.unmapped.append(("--expert-model-parallel-size", f"EP {ep} must divide the {dp} data-parallel ranks "
                                                           f"(megatron-core: expert ranks are data-parallel ranks); "
                                                           f"train.ep left at 1"))
    elif ep != 1:
        t.set("train.ep", ep, "--expert-model-parallel-size")
    return world


def _engine_layout(t: Translator, world: int) -> int:
    """engine.tp_size and num_engines, and how weights reach colocated engines; returns the GPUs per engine."""
    per_engine = t.int_flag("--rollout-num-gpus-per-engine", 1)
    colocate = "--colocate" in t.seen
    rollout_gpus = t.int_flag("--rollout-num-gpus", world if colocate else None)
    t.set("engine.tp_size", per_engine)
    if rollout_gpus is None:
        t.notes.append("no --rollout-num-gpus: engine.num_engines left at 1")
    elif rollout_gpus % per_engine:
        t.unmapped.append(("--rollout-num-gpus", f"{rollout_gpus} GPUs do not split into engines of {per_engine}"))
    else:
        t.set("engine.num_engines", max(1, rollout_gpus // per_engine))
    if colocate and "--update-weight-transport" not in t.seen:
        t.set("sync.transport", "disk")
        t.notes.append("--colocate: slime hands weights over in GPU memory; slimectl syncs colocated engines "
                       "through disk (sync.transport: disk)")
    elif not colocate and "--update-weight-transport" not in t.seen:
        t.set("sync.transport", "distributed")
    return per_engine


def _engine_groups(t: Translator, per_engine: int, base: Path | None) -> None:
    """``--sglang-config FILE``: the actor's model sets ``engine:``, the frozen ones ``engine.groups``."""
    from slimectl.stages.init.slime_sglang_config import map_sglang_config

    path = Path(one_value("--sglang-config", t.seen["--sglang-config"]))
    if not path.is_absolute() and base is not None and (base / path).is_file():
        path = base / path
    actor, groups, notes = map_sglang_config(path, t.get("model.path"), per_engine)
    for key in ("name", "num_engines", "tp_size"):
        t.set(f"engine.{key}", actor[key], "--sglang-config")
    if actor.get("sglang_args"):
        t.set("engine.sglang_args", {**(t.get("engine.sglang_args") or {}), **actor["sglang_args"]}, "--sglang-config")
    if groups:
        t.set("engine.groups", groups, "--sglang-config")
    t.notes += notes + [f"--sglang-config {path}: the actor's engines are model {actor['name']} ({actor['num_engines']} "
                        f"engine(s) of {actor['tp_size']} GPU(s)); frozen group(s): "
                        f"{', '.join(g['name'] for g in groups) or 'none'} (engine.groups)"]


def _closing_notes(t: Translator, world: int, per_engine: int) -> None:
    if "--rollout-max-response-len" not in t.seen:
        t.notes.append("no --rollout-max-response-len (slime generates up to the context length): "
                       "rollout.max_response_len keeps slimectl's default; set it")
    if "--hf-checkpoint" not in t.seen:
        t.notes.append("no --hf-checkpoint: set model.path to the HF model folder")
    if world > 1 or per_engine > 1:
        t.notes.append(f"the layout asks for {world} trainer GPU(s) (train.dp = {t.get('train.dp', 1)}) and engines "
                       f"of {per_engine}; on a CPU machine use --set train.dp=1 --set engine.backend=embedded")


def translate_slime_script(path: str | Path) -> SlimeTranslation:
    """Read a slime launch script and translate its ``train.py`` flags (see the module docstring)."""
    argv, script_name, notes = parse_launch_script(path)
    out = translate_slime_args(argv, script_name, Path(path).parent)
    out.notes = notes + out.notes
    out.script = str(path)
    return out
