"""slime's ``--sglang-config`` YAML as engine groups (``init --from-slime``; docs/engine-groups.md).

slime (``slime/backends/sglang_utils/sglang_config.py``) lists the served models under ``sglang:``, each with
``name``, ``model_path``, ``update_weights``, ``num_gpus_per_engine`` and ``server_groups`` (``engine_groups``, its
older name) of ``{worker_type, num_gpus, num_gpus_per_engine, overrides}``. The model that takes the trained
weights (``update_weights: true``, or unset with the ``--hf-checkpoint`` model or none) is the actor's group,
``engine:``; every other one becomes an entry of ``engine.groups`` with ``update_weights: false``. ``regular``
server groups are engines (num_gpus / num_gpus_per_engine of them, ``tp_size`` the GPUs of each), a group's
``overrides`` its SGLang flags; ``placeholder`` groups reserve GPUs only and are left out; PD and encoder
disaggregation (``prefill``, ``decode``, ``encoder``) is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from slimectl.contract.errors import ConfigError

MODEL_KEYS = frozenset({"name", "model_path", "num_gpus_per_engine", "server_groups", "engine_groups",
                        "update_weights"})
GROUP_KEYS = frozenset({"worker_type", "num_gpus", "num_gpus_per_engine", "overrides"})


def read_sglang_config(path: str | Path) -> list[dict[str, Any]]:
    """The ``sglang:`` model list of slime's YAML (one line naming the file when it is not one)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--sglang-config {path}: cannot read it ({' '.join(str(exc).split())})") from None
    models = data.get("sglang") if isinstance(data, dict) else None
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models) or not models:
        raise ConfigError(f"--sglang-config {path}: expected a top-level 'sglang:' list of models, as slime reads it")
    return models


def _engines(where: str, model: dict[str, Any], per_engine: int) -> tuple[int, int, dict[str, Any], list[str]]:
    """(engines, GPUs per engine, SGLang overrides, notes) of a model's regular server groups."""
    if "server_groups" in model and "engine_groups" in model:
        raise ConfigError(f"{where}: both server_groups and engine_groups; keep one")
    engines, sizes, overrides, notes = 0, set(), {}, []
    for i, g in enumerate(model.get("server_groups") or model.get("engine_groups") or []):
        unknown = sorted(set(g) - GROUP_KEYS) if isinstance(g, dict) else ["(not a mapping)"]
        if unknown:
            raise ConfigError(f"{where} server group {i}: unknown key(s) {', '.join(unknown)}")
        kind = g.get("worker_type", "regular")
        if kind == "placeholder":
            notes.append(f"{where} server group {i}: a placeholder reserves GPUs only; left out")
            continue
        if kind != "regular":
            raise ConfigError(f"{where} server group {i}: worker_type {kind} (PD or encoder disaggregation) is not "
                              f"supported; slimectl serves regular engines only")
        per = int(g.get("num_gpus_per_engine") or model.get("num_gpus_per_engine") or per_engine)
        gpus = int(g.get("num_gpus", 0))
        if gpus <= 0 or per <= 0 or gpus % per:
            raise ConfigError(f"{where} server group {i}: num_gpus {gpus} does not split into engines of {per} GPU(s)")
        engines += gpus // per
        sizes.add(per)
        for k, v in (g.get("overrides") or {}).items():
            key = str(k).replace("-", "_")
            if key in overrides and overrides[key] != v:
                raise ConfigError(f"{where}: its server groups set {key} differently; slimectl gives one model's "
                                  f"engines one setting")
            overrides[key] = v
    if len(sizes) > 1:
        raise ConfigError(f"{where}: its server groups have engines of {sorted(sizes)} GPUs; slimectl gives one "
                          f"model's engines one size")
    return engines, (sizes.pop() if sizes else per_engine), overrides, notes


def map_sglang_config(path: str | Path, hf_checkpoint: str | None, per_engine: int = 1
                      ) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """(the actor's ``engine`` keys, the frozen ``engine.groups`` entries, notes) of slime's YAML at ``path``.
    ``hf_checkpoint``: the script's ``--hf-checkpoint``; ``per_engine``: its ``--rollout-num-gpus-per-engine``."""
    actor: dict[str, Any] | None = None
    groups: list[dict[str, Any]] = []
    notes: list[str] = []
    for i, m in enumerate(read_sglang_config(path)):
        where = f"--sglang-config {path}: model {m.get('name', i)}"
        unknown = sorted(set(m) - MODEL_KEYS)
        if unknown or not m.get("name"):
            raise ConfigError(f"{where}: " + (f"unknown key(s) {', '.join(unknown)}" if unknown else "no name"))
        if any(g["name"] == m["name"] for g in groups) or (actor and actor["name"] == m["name"]):
            raise ConfigError(f"--sglang-config {path}: two models are named {m['name']}; give each its own name")
        engines, per, overrides, more = _engines(where, m, per_engine)
        notes += more
        model = overrides.pop("model_path", None) or m.get("model_path") or hf_checkpoint
        update = m.get("update_weights")
        if update is None:  # slime's rule: the --hf-checkpoint model is the one trained
            update = model in (None, hf_checkpoint)
        if update:
            if actor is not None:
                raise ConfigError(f"--sglang-config {path}: models {actor['name']} and {m['name']} both take the "
                                  f"trained weights (update_weights); only one may")
            actor = {"name": str(m["name"]), "num_engines": max(1, engines), "tp_size": per}
            if overrides:
                actor["sglang_args"] = overrides
            continue
        options: dict[str, Any] = {"tp_size": per, **({"sglang_args": overrides} if overrides else {})}
        groups.append({"name": str(m["name"]), **({"model": model} if model else {}), "num_engines": max(1, engines),
                       "options": options, "update_weights": False})
    if actor is None:
        raise ConfigError(f"--sglang-config {path}: no model takes the trained weights (update_weights: true, or the "
                          f"--hf-checkpoint model); mark the actor's")
    return actor, groups, notes
