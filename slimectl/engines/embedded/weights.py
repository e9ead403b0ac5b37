"""Weight updates of the embedded engine: by name, from tensors, from a checkpoint on disk, from a distributed group.

Every update is checked in full first (names, shapes, dtypes, and for a checkpoint the
architecture and completeness): a bad one raises ValueError and changes nothing. The copy itself
runs on the scheduler thread between two steps (:meth:`_run_control` of the runner).

Names are HF parameter names. Mixture-of-experts models are the exception to "one name, one
parameter": transformers 5 holds a layer's experts FUSED in memory (3-D
``mlp.experts.gate_up_proj`` [E, 2I, H] = each expert's gate rows then its up rows, and
``mlp.experts.down_proj`` [E, H, I]) while checkpoints on disk, exports and the trainer's sync
name them PER EXPERT (``mlp.experts.{e}.gate_proj.weight`` [I, H], ``up_proj``, ``down_proj``).
:func:`fused_expert_views` maps every per-expert name to a view of its slice of the fused
parameter, so every update path and ``get_weights_by_name`` accept both spellings: a per-expert
tensor is copied into (or received straight into) its slice, and read back from it.

A few MoE families also keep model state in a *buffer*: GLM-4.5's and DeepSeek-V3's routers hold
``mlp.gate.e_score_correction_bias`` (the per-expert routing bias that training moves). It is in
every checkpoint (a persistent buffer), so it is a weight here like a parameter: updated, required
from a full checkpoint, read back (:func:`persistent_buffers`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

# Config fields that must agree between the served model and a checkpoint loaded over it.
_ARCH_FIELDS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "tie_word_embeddings",
)


class WeightUpdates:
    """The weight methods of :class:`~slimectl.engines.embedded.scheduler.BatchRunner` (a mixin: it
    uses the runner's ``config``, ``_params``, ``model_path``, ``_weight_version`` and ``_run_control``)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       weight_version: str | None = None) -> None:
        """Copy tensors (HF parameter names) into the model between scheduler steps.

        Everything is checked first: an unknown name or a shape mismatch raises ValueError and
        nothing is applied.
        """
        items = self._check_named_tensors(named_tensors)
        self._apply_weights(items, weight_version)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        """Load the safetensors weights of a checkpoint of the same architecture and swap them in
        between scheduler steps (in-flight requests continue on the new weights)."""
        from transformers import AutoConfig

        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path {model_path!r} is not a model directory (no config.json)")
        try:
            other = AutoConfig.from_pretrained(model_path)
        except Exception as exc:  # malformed config
            raise ValueError(f"cannot read the config of {model_path!r}: {exc}") from None
        for key in _ARCH_FIELDS:
            mine, theirs = getattr(self.config, key, None), getattr(other, key, None)
            if key == "architectures":
                mine, theirs = list(mine or []), list(theirs or [])
            if mine != theirs:
                raise ValueError(f"checkpoint {model_path!r} does not match the served model: "
                                 f"{key} is {theirs!r}, expected {mine!r}")
        # Read straight into the parameters (no second copy of the model): names, shapes and
        # completeness are checked from the headers first; a read that fails midway leaves the
        # version ``<old>-incomplete``, as a failed receive does (receive_weights).
        from slimectl.backends.hf.checkpoint import HFCheckpoint
        from slimectl.contract.errors import SlimectlError

        try:
            ckpt = HFCheckpoint(path)
        except SlimectlError as exc:
            raise ValueError(str(exc)) from None
        with ckpt:
            specs = [(n, ckpt.dtype(n), ckpt.shape(n)) for n in ckpt.names()]
            self._check_specs(specs)
            missing = self._missing_from({n for n, _, _ in specs})
            if missing:
                raise ValueError(f"checkpoint {model_path!r} is missing parameter {missing[0]!r}"
                                 + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
            order = iter([n for n, _, _ in specs])

            def read(out: torch.Tensor) -> None:
                try:
                    ckpt.get(next(order), out=out)
                except SlimectlError as exc:
                    raise ValueError(str(exc)) from None

            self.receive_weights(specs, read, weight_version)
        self.model_path = str(model_path)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first ``truncate_size`` rows (dim 0) of parameter ``name`` as float32 nested lists —
        SGLang's ``/get_weights_by_name`` semantics; used by ``slimectl sync --verify``."""
        p = self._weight_targets().get(name)
        if p is None:
            raise KeyError(name)
        with torch.no_grad():
            return p.detach()[: max(0, int(truncate_size))].to(torch.float32).tolist()

    def receive_weights(self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], recv,
                        weight_version: str | None = None) -> None:
        """Fill parameters straight from ``recv(tensor)`` (a collective receive), between scheduler
        steps: no staging copy when the dtype matches the parameter's.

        Names and shapes are checked before anything is received (ValueError, nothing applied).
        If a receive fails midway the model holds a mix, so the weight version becomes
        ``<old>-incomplete`` (rollouts refuse mixed versions; the next full update fixes it).
        """
        targets = self._check_specs(specs)
        if weight_version is not None and (not isinstance(weight_version, str) or not weight_version):
            raise ValueError(f"weight_version must be a non-empty string, got {weight_version!r}")

        def apply():
            try:
                with torch.no_grad():
                    for name, dtype, shape in specs:
                        p = targets[name]
                        if p.dtype == dtype and p.is_contiguous():
                            recv(p.data)
                        else:
                            buf = torch.empty(tuple(shape), dtype=dtype, device=p.device)
                            recv(buf)
                            p.copy_(buf.to(p.dtype))
            except BaseException:
                self._weight_version = f"{self._weight_version}-incomplete"
                raise
            if weight_version is not None:
                self._weight_version = weight_version

        self._run_control(apply)

    def _check_specs(self, specs) -> dict[str, torch.Tensor]:
        """ValueError unless every (name, dtype, shape) names a weight of that shape and a floating
        dtype; returns the weight targets."""
        targets = self._weight_targets()
        for name, dtype, shape in specs:
            param = targets.get(name)
            if param is None:
                raise ValueError(f"unknown parameter name {name!r}")
            if tuple(shape) != tuple(param.shape):
                raise ValueError(f"shape mismatch for {name!r}: got {tuple(shape)}, expected {tuple(param.shape)}")
            if not dtype.is_floating_point and param.is_floating_point():
                raise ValueError(f"dtype mismatch for {name!r}: got {dtype}, expected a floating point tensor")
        return targets

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        """Every name an update may write or a read-back may read: the parameters (tied ones under
        both names) and, for fused MoE experts, each expert's per-expert HF names (views)."""
        targets = getattr(self, "_targets", None)
        if targets is None:
            views = fused_expert_views(self.model)
            parts: dict[str, list[str]] = {}
            for name, (fused, _) in views.items():
                parts.setdefault(fused, []).append(name)
            self._fused_parts = parts
            self._state_buffers = persistent_buffers(self.model)
            targets = self._targets = {**self._params, **self._state_buffers,
                                       **{n: v for n, (_, v) in views.items()}}
        return targets

    def _missing_from(self, given: set[str]) -> list[str]:
        """The names a full checkpoint lacks, given the names it has: a parameter is covered by its
        name (a tied one by either name) or, when fused, by every one of its per-expert names; the
        missing pieces of a fused parameter are named per expert, as checkpoints spell them."""
        self._weight_targets()
        weights = {**self._params, **self._state_buffers}
        covered = {p.data_ptr() for n, p in weights.items() if n in given}
        missing: dict[str, None] = {}
        for n, p in weights.items():
            if p.data_ptr() in covered:
                continue
            parts = self._fused_parts.get(n)
            lacking = [x for x in parts if x not in given] if parts else [n]
            if not lacking:
                covered.add(p.data_ptr())
            missing.update(dict.fromkeys(lacking))
        return list(missing)

    def _check_named_tensors(self, named_tensors) -> list[tuple[str, torch.Tensor]]:
        items = []
        targets = self._weight_targets()
        for entry in named_tensors:
            try:
                name, tensor = entry
            except (TypeError, ValueError):
                raise ValueError("named_tensors must be (name, tensor) pairs") from None
            param = targets.get(name)
            if param is None:
                raise ValueError(f"unknown parameter name {name!r}")
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"value for {name!r} is not a tensor")
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"shape mismatch for {name!r}: got {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            if not (tensor.is_floating_point() or tensor.is_complex()) and param.is_floating_point():
                raise ValueError(f"dtype mismatch for {name!r}: got {tensor.dtype}, expected a floating point tensor")
            items.append((name, tensor))
        return items

    def _apply_weights(self, items, weight_version, after=None) -> None:
        if weight_version is not None and (not isinstance(weight_version, str) or not weight_version):
            raise ValueError(f"weight_version must be a non-empty string, got {weight_version!r}")

        targets = self._weight_targets()

        def apply():
            with torch.no_grad():
                for name, tensor in items:
                    p = targets[name]
                    p.copy_(tensor.to(device=p.device, dtype=p.dtype))
            if after is not None:
                after()
            if weight_version is not None:
                self._weight_version = weight_version

        self._run_control(apply)


def persistent_buffers(model) -> dict[str, torch.Tensor]:
    """The floating-point buffers a checkpoint holds (``state_dict`` keeps persistent buffers only:
    not rotary tables), by HF name: GLM-4.5's ``mlp.gate.e_score_correction_bias``."""
    saved = set(model.state_dict(keep_vars=True))
    return {n: b for n, b in model.named_buffers(remove_duplicate=False)
            if n in saved and b is not None and b.is_floating_point()}


def fused_expert_views(model) -> dict[str, tuple[str, torch.Tensor]]:
    """Per-expert HF name -> (name of the fused parameter, view of that expert's slice of it).

    Finds every experts module of transformers 5's fused layout (``@use_experts_implementation``:
    3-D ``gate_up_proj`` (or ``up_proj`` without a gate) and ``down_proj``, expert index first)
    wherever it sits, and reads the layout from the module's own flags: ``is_concatenated``
    ([gate; up] rows, the default) or interleaved (gate0, up0, gate1, ...), ``is_transposed``
    ([E, in, out] instead of [E, out, in]) and ``has_bias``. The per-expert names are the
    Qwen2-MoE family's (Qwen3-MoE, DeepSeek, GLM-4.5, OLMoE ... on the hub and in transformers'
    conversion mapping): ``PREFIX.experts.{e}.gate_proj.weight`` / ``up_proj`` / ``down_proj``
    (and ``.bias``). A view shares the parameter's memory: copying into it writes the slice.
    """
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for mod_name, mod in model.named_modules():
        own = dict(mod.named_parameters(recurse=False))
        has_gate = bool(getattr(mod, "has_gate", "gate_up_proj" in own))
        first = own.get("gate_up_proj" if has_gate else "up_proj")
        down = own.get("down_proj")
        if first is None or down is None or first.dim() != 3 or down.dim() != 3 or first.shape[0] != down.shape[0]:
            continue
        transposed = bool(getattr(mod, "is_transposed", False))
        concatenated = bool(getattr(mod, "is_concatenated", True))
        prefix = f"{mod_name}." if mod_name else ""

        def halves(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
            n = t.shape[dim] // 2
            if concatenated:
                return t.narrow(dim, 0, n), t.narrow(dim, n, n)
            idx = [slice(None)] * t.dim()
            gate, up = list(idx), list(idx)
            gate[dim], up[dim] = slice(0, None, 2), slice(1, None, 2)
            return t[tuple(gate)], t[tuple(up)]

        def weight(t: torch.Tensor) -> torch.Tensor:  # one expert's matrix as HF's [out, in]
            return t.t() if transposed else t

        with torch.no_grad():
            fused = {k: own[k].detach() for k in ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias",
                                                   "up_proj_bias", "down_proj_bias") if k in own}
            for e in range(first.shape[0]):
                base = f"{prefix}{e}."
                if has_gate:
                    gate, up = halves(fused["gate_up_proj"][e], 1 if transposed else 0)
                    out[base + "gate_proj.weight"] = (prefix + "gate_up_proj", weight(gate))
                    out[base + "up_proj.weight"] = (prefix + "gate_up_proj", weight(up))
                    if "gate_up_proj_bias" in fused:
                        gb, ub = halves(fused["gate_up_proj_bias"][e], 0)
                        out[base + "gate_proj.bias"] = (prefix + "gate_up_proj_bias", gb)
                        out[base + "up_proj.bias"] = (prefix + "gate_up_proj_bias", ub)
                else:
                    out[base + "up_proj.weight"] = (prefix + "up_proj", weight(fused["up_proj"][e]))
                    if "up_proj_bias" in fused:
                        out[base + "up_proj.bias"] = (prefix + "up_proj_bias", fused["up_proj_bias"][e])
                out[base + "down_proj.weight"] = (prefix + "down_proj", weight(fused["down_proj"][e]))
                if "down_proj_bias" in fused:
                    out[base + "down_proj.bias"] = (prefix + "down_proj_bias", fused["down_proj_bias"][e])
    return out
