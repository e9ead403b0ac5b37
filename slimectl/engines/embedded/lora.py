"""The embedded engine's LoRA adapters: PEFT adapters read and checked against the served model, held by name on top
of the untouched base weights, and applied unmerged, per row of a batch.

An adapter comes from a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``, as
``PeftModel.save_pretrained`` writes it, read by :mod:`slimectl.backends.hf.peft_adapter`: a pickled ``.bin`` is
refused, never unpickled) or from tensors received over
a weight-update group under the same PEFT names (``base_model.model.<module>.lora_A.weight`` [r, in] and
``...lora_B.weight`` [out, r]). Everything is checked against the served model before anything changes: plain LoRA
only (no rsLoRA, DoRA, bias, modules_to_save, per-module rank or alpha patterns ...), every target an ``nn.Linear``
of the decoder with both matrices in its shapes, every module ``target_modules`` names covered.

:class:`LoraAdapters` holds the adapters by name and hooks the targeted linears: a forward hook adds
``B (A x) * lora_alpha / r`` to ``W x`` for the rows whose request asked for that adapter (PEFT's order of operations,
so logits match PEFT's); :meth:`LoraAdapters.rows` says, around each forward, which adapter each row uses. Installs,
removals and the forwards all run on the scheduler thread, so an adapter is replaced between two steps.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from slimectl.backends.hf.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter
from slimectl.contract.errors import SlimectlError

__all__ = ["FROM_DISTRIBUTED", "AdapterShape", "LoraAdapter", "LoraAdapters"]

#: The ``lora_path`` reported for an adapter received over a weight-update group (SGLang says ``__tensor__`` for one
#: loaded from tensors).
FROM_DISTRIBUTED = "__distributed__"

#: A LoRA weight's PEFT name (the adapter's own name, ``.default``, when PEFT saved it with one).
_PEFT_NAME = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight")

#: PEFT config keys this engine does not implement: key -> (the values that mean "off", what it is).
_UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "use_rslora": ((False, None), "rank-stabilised scaling (use_rslora)"),
    "use_dora": ((False, None), "DoRA (use_dora)"),
    "bias": (("none", None), "trained biases (bias)"),
    "lora_bias": ((False, None), "a bias on lora_B (lora_bias)"),
    "modules_to_save": ((None, []), "fully trained modules (modules_to_save)"),
    "rank_pattern": ((None, {}), "per-module ranks (rank_pattern)"),
    "alpha_pattern": ((None, {}), "per-module alphas (alpha_pattern)"),
    "layers_to_transform": ((None, []), "a subset of layers (layers_to_transform)"),
    "layer_replication": ((None, []), "layer replication (layer_replication)"),
    "fan_in_fan_out": ((False, None), "transposed (Conv1D) weights (fan_in_fan_out)"),
    "target_parameters": ((None, []), "LoRA on bare parameters (target_parameters)"),
    "trainable_token_indices": ((None, [], {}), "trainable tokens (trainable_token_indices)"),
    "use_qalora": ((False, None), "QA-LoRA (use_qalora)"),
    "use_bdlora": ((False, None), "BD-LoRA (use_bdlora)"),
    "alora_invocation_tokens": ((None, []), "activated LoRA (alora_invocation_tokens)"),
    "arrow_config": ((None, {}), "Arrow routing (arrow_config)"),
}


@dataclass(frozen=True)
class AdapterShape:
    """A checked adapter config: rank, alpha, the scale ``lora_alpha / r``, and the PEFT tensor names it needs, each
    with the module it belongs to and its shape."""

    r: int
    alpha: float
    tensors: dict[str, tuple[str, str, tuple[int, int]]]  # PEFT name -> (module, "A" | "B", shape)

    @property
    def scale(self) -> float:
        return self.alpha / self.r


@dataclass
class LoraAdapter:
    """One loaded adapter: per targeted module its ``(A [r, in], B [out, r])`` in the served dtype."""

    name: str
    source: str  # the lora_path it came from (FROM_DISTRIBUTED when received)
    r: int
    alpha: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ab in self.weights.values() for t in ab)


def check_adapter_name(name) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"lora_name must be a non-empty string, got {name!r}")
    return name


def _check_config_kind(config: dict, where: str) -> tuple[int, float]:
    """The rank and alpha of a plain-LoRA config; ValueError naming the first thing this engine does not serve."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: the adapter config must be a JSON object, got {type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type is {config.get('peft_type')!r}; the embedded engine serves LoRA "
                         f"adapters only (peft_type LORA)")
    for key, (off, what) in _UNSUPPORTED.items():
        if config.get(key) not in off:
            raise ValueError(f"{where}: {what} is not supported by the embedded engine ({key}={config[key]!r}); "
                             f"train a plain LoRA adapter")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ValueError(f"{where}: lora_alpha must be a positive number, got {alpha!r}")
    return r, float(alpha)


def _matches(module: str, targets, exclude) -> bool:
    """PEFT's module matching: a list names module suffixes, a string is a full-match regex (``all-linear``: every
    linear of the decoder); ``exclude_modules`` the same way, taking modules out."""
    def hit(spec) -> bool:
        if spec is None:
            return False
        if isinstance(spec, str):
            return spec == "all-linear" or re.fullmatch(spec, module) is not None
        return any(module == t or module.endswith(f".{t}") for t in spec)

    return hit(targets) and not hit(exclude)


class LoraAdapters:
    """The adapters the engine holds, by name, and the forward hooks on the decoder's linears that apply them.

    ``linears`` are the ``nn.Linear`` modules an adapter may target (the decoder's, by their name in the causal LM,
    as PEFT names them). Everything but :meth:`check` and the reads runs on the scheduler thread."""

    def __init__(self, model, decoder):
        inside = {id(m) for m in decoder.modules()}
        self.linears: dict[str, torch.nn.Linear] = {
            n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and id(m) in inside}
        self.dtype = next(model.parameters()).dtype
        self.adapters: dict[str, LoraAdapter] = {}
        self._hooked: set[str] = set()
        self._plan: list[tuple[LoraAdapter, torch.Tensor | None]] | None = None

    # -- what requests and the server read ---------------------------------------------------------
    def loaded(self) -> dict[str, str]:
        """SGLang's ``loaded_adapters``: name -> lora_path."""
        return {n: a.source for n, a in self.adapters.items()}

    def unknown_name_message(self, name) -> str:
        loaded = sorted(self.adapters)
        return (f"lora_path {name!r} is not a loaded LoRA adapter (loaded: {loaded or 'none'}); "
                f"POST /load_lora_adapter first, or send no lora_path for the base model")

    # -- checking ----------------------------------------------------------------------------------
    def check(self, config: dict, names: list[str], where: str) -> AdapterShape:
        """Check a config and the PEFT tensor names that come with it against the served model (ValueError naming
        the first problem): every name a module's lora_A or lora_B, every module a decoder linear that
        ``target_modules`` names, every such linear covered by both matrices. Returns the shapes the tensors
        must have."""
        r, alpha = _check_config_kind(config, where)
        targets, exclude = config.get("target_modules"), config.get("exclude_modules")
        if not targets:
            raise ValueError(f"{where}: target_modules is empty; name the linear modules the adapter trains")
        if isinstance(targets, (list, tuple)):
            for t in targets:
                if not any(m == t or m.endswith(f".{t}") for m in self.linears):
                    raise ValueError(f"{where}: target module {t!r} is not a linear module of the served model's "
                                     f"decoder; drop it from target_modules")
        want = [m for m in self.linears if _matches(m, targets, exclude)]
        if not want:
            raise ValueError(f"{where}: target_modules {targets!r} names no linear module of the served model's "
                             f"decoder (its linears end in {sorted({m.rsplit('.', 1)[-1] for m in self.linears})})")
        tensors = {name: self._tensor_shape(name, r, targets, exclude, where) for name in names}
        have = {(m, ab) for m, ab, _ in tensors.values()}
        for m in want:
            for ab in ("A", "B"):
                if (m, ab) not in have:
                    raise ValueError(f"{where}: no lora_{ab} weight for module {m!r}, which target_modules names "
                                     f"(base_model.model.{m}.lora_{ab}.weight)")
        return AdapterShape(r, alpha, tensors)

    def _tensor_shape(self, name: str, r: int, targets, exclude, where: str) -> tuple[str, str, tuple[int, int]]:
        match = _PEFT_NAME.fullmatch(name) if isinstance(name, str) else None
        if match is None:
            raise ValueError(f"{where}: tensor {name!r} is not a LoRA weight of a PEFT adapter "
                             f"(base_model.model.<module>.lora_A.weight / lora_B.weight)")
        module, ab = match["module"], match["ab"]
        linear = self.linears.get(module)
        if linear is None:
            raise ValueError(f"{where}: module {module!r} (tensor {name!r}) is not a linear module of the served "
                             f"model's decoder; was the adapter trained on this model?")
        if not _matches(module, targets, exclude):
            raise ValueError(f"{where}: module {module!r} has weights but target_modules {targets!r} does not "
                             f"name it; fix the adapter's config")
        shape = (r, linear.in_features) if ab == "A" else (linear.out_features, r)
        return module, ab, shape

    @staticmethod
    def _check_tensor(name: str, shape, dtype: torch.dtype, want: tuple[int, int], where: str) -> None:
        if tuple(shape) != want:
            raise ValueError(f"{where}: tensor {name!r} has shape {list(shape)}, the served model needs {list(want)} "
                             f"(lora_A is [r, in_features], lora_B [out_features, r]); was the adapter trained on "
                             f"this model, with this r?")
        if not dtype.is_floating_point:
            raise ValueError(f"{where}: tensor {name!r} is {dtype}, expected a floating-point tensor")

    # -- reading -----------------------------------------------------------------------------------
    def read_dir(self, name: str, path: str) -> LoraAdapter:
        """The adapter of a PEFT directory (read by :func:`~slimectl.backends.hf.peft_adapter.read_adapter`:
        safetensors only), checked in full (ValueError naming the problem; nothing installed)."""
        check_adapter_name(name)
        if not isinstance(path, str) or not path or not Path(path).is_dir():
            raise ValueError(f"lora_path {path!r} is not a directory; send the PEFT adapter directory "
                             f"({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})")
        try:
            config, tensors = read_adapter(path)
        except SlimectlError as exc:
            raise ValueError(str(exc)) from None
        where = f"LoRA adapter {path!r}"
        shape = self.check(config, list(tensors), where)
        for n, t in tensors.items():
            self._check_tensor(n, t.shape, t.dtype, shape.tensors[n][2], where)
        return self._assemble(name, str(path), shape, tensors)

    def receive(self, name: str, config: dict, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                recv: Callable[[torch.Tensor], None]) -> LoraAdapter:
        """An adapter whose PEFT-named tensors (``specs``: name, dtype, shape, in the sender's order) come from
        ``recv(tensor)`` (a collective receive): all checked before the first receive (ValueError, nothing
        received), received into fresh buffers (the served adapters stay untouched until it is installed)."""
        check_adapter_name(name)
        where = f"LoRA adapter {name!r}"
        shape = self.check(config, [n for n, _, _ in specs], where)
        for n, dtype, s in specs:
            self._check_tensor(n, s, dtype, shape.tensors[n][2], where)
        tensors = {}
        for n, dtype, s in specs:
            buf = torch.empty(tuple(s), dtype=dtype)
            recv(buf)
            tensors[n] = buf
        return self._assemble(name, FROM_DISTRIBUTED, shape, tensors)

    def _assemble(self, name: str, source: str, shape: AdapterShape, tensors: dict[str, torch.Tensor]) -> LoraAdapter:
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for n, t in tensors.items():
            module, ab, _ = shape.tensors[n]
            device = self.linears[module].weight.device
            # always a copy of its own: fresh, allocator-aligned memory whichever way the tensor arrived (a view into
            # a file's bytes would put the adapter at another alignment than one received: other bits from MKL)
            parts.setdefault(module, {})[ab] = t.to(device=device, dtype=self.dtype, copy=True,
                                                    memory_format=torch.contiguous_format)
        weights = {m: (p["A"], p["B"]) for m, p in parts.items()}
        return LoraAdapter(name, source, shape.r, shape.alpha, weights)

    # -- installing (scheduler thread) -------------------------------------------------------------
    def install(self, adapter: LoraAdapter) -> None:
        """Serve ``adapter`` under its name (replacing one of that name): from the next forward on."""
        for module in adapter.weights:
            if module not in self._hooked:
                self.linears[module].register_forward_hook(functools.partial(self._apply, module))
                self._hooked.add(module)
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> LoraAdapter:
        """Stop serving adapter ``name`` (KeyError if none has that name)."""
        return self.adapters.pop(name)

    def release_all(self) -> int:
        """Drop every adapter (the engine's weights are being released); returns their bytes."""
        freed = sum(a.nbytes for a in self.adapters.values())
        self.adapters.clear()
        return freed

    # -- the forward -------------------------------------------------------------------------------
    @contextmanager
    def rows(self, names: list[str | None]) -> Iterator[None]:
        """Around one forward of a batch: row ``i`` uses adapter ``names[i]`` (None: the base model). All rows on
        one adapter take a fast path (no row gather)."""
        self._plan = self._make_plan(names)
        try:
            yield
        finally:
            self._plan = None

    def _make_plan(self, names: list[str | None]) -> list[tuple[LoraAdapter, torch.Tensor | None]] | None:
        if not self.adapters or all(n is None for n in names):
            return None
        if all(n == names[0] for n in names):
            return [(self.adapters[names[0]], None)]
        groups: dict[str, list[int]] = {}
        for i, n in enumerate(names):
            if n is not None:
                groups.setdefault(n, []).append(i)
        return [(self.adapters[n], torch.tensor(idx, dtype=torch.long)) for n, idx in groups.items()]

    def _apply(self, module: str, _linear, args, output: torch.Tensor) -> torch.Tensor | None:
        """Forward hook on a targeted linear: ``y + B (A x) * scale`` for the rows of each adapter that targets it."""
        plan = self._plan
        if plan is None:
            return None
        x = args[0]
        for adapter, idx in plan:
            ab = adapter.weights.get(module)
            if ab is None:
                continue
            a, b = ab
            if idx is None:
                output = output + F.linear(F.linear(x, a), b) * adapter.scale
            else:
                delta = F.linear(F.linear(x.index_select(0, idx), a), b) * adapter.scale
                output = output.index_add(0, idx, delta)
        return output
