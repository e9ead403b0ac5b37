"""The embedded engine's weights: by HF name, updated from a checkpoint on disk or a distributed group, read back.

Every update is checked in full first (names, shapes, dtypes, and for a checkpoint the
architecture and completeness): a bad one raises ValueError and changes nothing. The copy itself
runs on the scheduler thread between two steps (the scheduler runs what :class:`ServedWeights` returns).

Names are HF parameter names. Mixture-of-experts models are the exception to "one name, one
parameter": transformers 5 holds a layer's experts FUSED in memory (3-D
``mlp.experts.gate_up_proj`` [E, 2I, H] = each expert's gate rows then its up rows, and
``mlp.experts.down_proj`` [E, H, I]) while checkpoints on disk, exports and the trainer's sync
name them PER EXPERT (``mlp.experts.{e}.gate_proj.weight`` [I, H], ``up_proj``, ``down_proj``).
:func:`fused_expert_views` maps every per-expert name to a view of its slice of the fused
parameter, so every update path and ``get_weights_by_name`` accept both spellings: a per-expert
tensor is copied into (or received straight into) its slice, and read back from it.

Multi-token-prediction layers (GLM-4.5, DeepSeek-V3: ``model.layers.{num_hidden_layers + k}.``) are not served:
transformers builds none, and every update skips their tensors (:meth:`ServedWeights.ignores`), so a trainer that
publishes or sends them (``train.mtp``) updates the engine as any other.

A few MoE families also keep model state in a *buffer*: GLM-4.5's and DeepSeek-V3's routers hold
``mlp.gate.e_score_correction_bias`` (the per-expert routing bias that training moves). It is in
every checkpoint (a persistent buffer), so it is a weight here like a parameter: updated, required
from a full checkpoint, read back (:func:`persistent_buffers`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from slimectl.contract.faults import fault_point

# Config fields that must agree between the served model and a checkpoint loaded over it.
_ARCH_FIELDS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "tie_word_embeddings",
)


class ServedWeights:
    """The served model's weights by HF name, and the label of their version.

    Every update is checked in full before anything is written (:meth:`receiver`, :meth:`checkpoint`); the
    write itself is a function the scheduler runs on its thread between two steps. Released weights
    (:meth:`release`) keep their names and shapes but hold no storage until :meth:`reallocate`.
    """

    def __init__(self, model, config, params: dict[str, torch.nn.Parameter], version: str):
        self.model, self.config = model, config
        self.params = params  # by HF name (tied weights appear under both names)
        self.version = str(version)
        self._targets: dict[str, torch.Tensor] | None = None
        self._fused_parts: dict[str, list[str]] = {}
        self._state_buffers: dict[str, torch.Tensor] = {}
        # The digest of the weights served (weight_delta.digest: xxh3-128 over every tensor's checksum) when known:
        # set by a load whose directory records it (recorded_digest) and by a delta's apply; None after any other
        # write. A delta whose base_digest it is applies without a checksum of its base tensors.
        self.digest: str | None = None

    def ignores(self, name: str) -> bool:
        """Whether an update's tensor ``name`` is skipped: a multi-token-prediction layer's (not served)."""
        from slimectl.backends.hf.mtp import is_mtp_hf_name

        mtp = getattr(self.config, "num_nextn_predict_layers", 0) or 0
        return bool(mtp) and is_mtp_hf_name(name, int(self.config.num_hidden_layers), int(mtp))

    @staticmethod
    def check_version(v) -> None:
        if not isinstance(v, str) or not v:
            raise ValueError(f"weight_version must be a non-empty string, got {v!r}")

    def receiver(self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], recv,
                 weight_version: str | None = None, digest: str | None = None) -> Callable[[], None]:
        """Check ``specs`` (name, dtype, shape) and ``weight_version`` now (ValueError, nothing applied) and return
        the function that fills the weights straight from ``recv(tensor)`` (a collective receive): no staging
        copy when the dtype matches the parameter's. If a receive fails midway the model holds a mix, so the
        version becomes ``<old>-incomplete`` (rollouts refuse mixed versions; the next full update fixes it).
        ``digest``: the digest of every weight once filled (a whole checkpoint's, :func:`recorded_digest`), None
        when unknown."""
        targets = self.check_specs(specs)
        if weight_version is not None:
            self.check_version(weight_version)

        def fill() -> None:
            self.digest = None
            try:
                with torch.no_grad():
                    for name, dtype, shape in specs:
                        p = targets.get(name)
                        if p is None:  # an ignored tensor (ignores): received and dropped
                            recv(torch.empty(tuple(shape), dtype=dtype))
                        elif p.dtype == dtype and p.is_contiguous():
                            recv(p.data)
                        else:
                            buf = torch.empty(tuple(shape), dtype=dtype, device=p.device)
                            recv(buf)
                            p.copy_(buf.to(p.dtype))
            except BaseException:
                self.version = f"{self.version}-incomplete"
                raise
            if weight_version is not None:
                self.version = weight_version
            self.digest = digest

        return fill

    def delta_applier(self, header: dict, blob, weight_version: str) -> Callable[[], None]:
        """Check a weight delta (:mod:`slimectl.backends.hf.weight_delta`) against the served weights and compute
        every changed tensor's new value now (DeltaError, nothing applied: not on its base version, a weight whose
        bytes are not the base's, a corrupt or truncated delta); return the swap that writes them in and sets the
        version, run between two scheduler steps (in memory: it cannot stop halfway). When the digest of the
        served weights is known and is the delta's ``base_digest``, the base tensors are not checksummed and an
        unchanged tensor costs nothing; otherwise every base tensor's checksum is compared with the delta's."""
        from slimectl.backends.hf.weight_delta import DeltaError, check_digests, check_tensor, read_header

        self.check_version(weight_version)
        header = read_header(header)
        if self.version != str(header["base_version"]):
            raise DeltaError(f"this engine serves weight version {self.version}, the delta applies to "
                             f"{header['base_version']}", kind="base")
        check_digests(header)
        known = self.digest is not None and self.digest == header["base_digest"]
        targets = self.targets()
        changes = []
        for e in header["entries"]:
            if self.ignores(e.name):
                continue
            if e.name not in targets:
                raise DeltaError(f"unknown parameter name {e.name!r}", kind="base")
            change = check_tensor(targets[e.name].detach(), e, blob, header, base_known=known)
            if change is not None:
                changes.append((targets[e.name], change))
        fault_point("engine.delta_checked")

        def swap() -> None:
            with torch.no_grad():
                for target, change in changes:
                    change.write_into(target.detach())
            self.version = weight_version
            self.digest = header["digest"]

        return swap

    @contextmanager
    def checkpoint(self, model_path: str) -> Iterator[tuple[list, Callable[[torch.Tensor], None]]]:
        """The safetensors weights of a checkpoint of the same architecture, checked in full from its config and
        headers (architecture, names, shapes, completeness; ValueError otherwise): yields their specs and a
        ``read(out)`` that reads the next of them, in that order, straight into ``out`` (no second copy of the
        model)."""
        from slimectl.backends.hf.checkpoint import HFCheckpoint
        from slimectl.contract.errors import SlimectlError

        self._check_architecture(model_path)
        try:
            ckpt = HFCheckpoint(Path(model_path))
        except SlimectlError as exc:
            raise ValueError(str(exc)) from None
        with ckpt:
            specs = [(n, ckpt.dtype(n), ckpt.shape(n)) for n in ckpt.names() if not self.ignores(n)]
            self.check_specs(specs)
            missing = self.missing_from({n for n, _, _ in specs})
            if missing:
                raise ValueError(f"checkpoint {model_path!r} is missing parameter {missing[0]!r}"
                                 + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
            order = iter([n for n, _, _ in specs])

            def read(out: torch.Tensor) -> None:
                try:
                    ckpt.get(next(order), out=out)
                except SlimectlError as exc:
                    raise ValueError(str(exc)) from None

            yield specs, read

    def _check_architecture(self, model_path: str) -> None:
        from transformers import AutoConfig

        if not (Path(model_path) / "config.json").is_file():
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

    def read(self, name: str, truncate_size: int = 100) -> list:
        """The first ``truncate_size`` rows (dim 0) of weight ``name`` as float32 nested lists —
        SGLang's ``/get_weights_by_name`` semantics; used by ``slimectl sync --verify``. KeyError: no such name."""
        p = self.targets().get(name)
        if p is None:
            raise KeyError(name)
        with torch.no_grad():
            return p.detach()[: max(0, int(truncate_size))].to(torch.float32).tolist()

    def checksums(self, names: list[str] | None = None) -> dict:
        """The xxh3-128 checksum of the raw bytes of every weight in ``names`` (every name an update may write when
        None), with its dtype and shape, and the version they are: ``{"weight_version", "checksums": {name:
        {"dtype", "shape", "xxh3_128"}}, "unknown": [names this engine has no weight of]}``. ``sync --verify``
        compares them with ``weights/N``'s: every tensor, bit for bit, a few dozen bytes each on the wire."""
        from slimectl.backends.hf.dtypes import dtype_name
        from slimectl.backends.hf.weight_delta import checksum

        targets = self.targets()
        wanted = list(targets) if names is None else list(names)
        sums, unknown = {}, []
        with torch.no_grad():
            for n in wanted:
                t = targets.get(n)
                if t is None:
                    unknown.append(n)
                    continue
                sums[n] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "xxh3_128": checksum(t.detach())}
        return {"weight_version": self.version, "algorithm": "xxh3_128", "checksums": sums, "unknown": unknown}

    def check_specs(self, specs) -> dict[str, torch.Tensor]:
        """ValueError unless every (name, dtype, shape) names a weight of that shape and a floating
        dtype; returns the weight targets."""
        targets = self.targets()
        for name, dtype, shape in specs:
            param = targets.get(name)
            if param is None and self.ignores(name):
                continue
            if param is None:
                raise ValueError(f"unknown parameter name {name!r}")
            if tuple(shape) != tuple(param.shape):
                raise ValueError(f"shape mismatch for {name!r}: got {tuple(shape)}, expected {tuple(param.shape)}")
            if not dtype.is_floating_point and param.is_floating_point():
                raise ValueError(f"dtype mismatch for {name!r}: got {dtype}, expected a floating point tensor")
        return targets

    def targets(self) -> dict[str, torch.Tensor]:
        """Every name an update may write or a read-back may read: the parameters (tied ones under
        both names) and, for fused MoE experts, each expert's per-expert HF names (views)."""
        if self._targets is None:
            views = fused_expert_views(self.model)
            parts: dict[str, list[str]] = {}
            for name, (fused, _) in views.items():
                parts.setdefault(fused, []).append(name)
            self._fused_parts = parts
            self._state_buffers = persistent_buffers(self.model)
            self._targets = {**self.params, **self._state_buffers, **{n: v for n, (_, v) in views.items()}}
        return self._targets

    def missing_from(self, given: set[str]) -> list[str]:
        """The names a full checkpoint lacks, given the names it has: a parameter is covered by its
        name (a tied one by either name) or, when fused, by every one of its per-expert names; the
        missing pieces of a fused parameter are named per expert, as checkpoints spell them."""
        self.targets()
        weights = {**self.params, **self._state_buffers}
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

    def release(self) -> int:
        """Swap every parameter's data for a 0-byte stand-in of the same shape and dtype (a broadcast
        scalar: shape checks still pass, a write into it raises); returns the bytes let go."""
        freed = 0
        with torch.inference_mode(False), torch.no_grad():
            for p in self._unique_params():
                freed += p.numel() * p.element_size()
                p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
        self._targets = None  # the fused-expert views of the old storage
        self.digest = None
        return freed

    def reallocate(self) -> int:
        """Give the (released) parameters storage again (uninitialised: the next weight update fills it);
        returns the bytes allocated."""
        alloc = 0
        with torch.inference_mode(False), torch.no_grad():
            for p in self._unique_params():
                p.data = torch.empty(p.shape, dtype=p.dtype, device=p.device)
                alloc += p.numel() * p.element_size()
        self._targets = None
        self.digest = None
        return alloc

    def _unique_params(self) -> list[torch.nn.Parameter]:
        """Each parameter once (tied weights appear under several names but are one parameter: freed once)."""
        return list({id(p): p for p in self.params.values()}.values())


def recorded_digest(model_path) -> str | None:
    """The digest of the weights of a ``weights/N`` directory as its ``delta.json`` records it (``digest``: the
    xxh3-128 over its tensors' checksums, sealed with them by the same READY manifest); None without one."""
    import json

    try:
        found = json.loads((Path(model_path) / "delta.json").read_text()).get("digest")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


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
