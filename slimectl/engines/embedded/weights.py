"""Weight updates of the embedded engine: by name, from tensors, from a checkpoint on disk, from a distributed group.

Every update is checked in full first (names, shapes, dtypes, and for a checkpoint the
architecture and completeness): a bad one raises ValueError and changes nothing. The copy itself
runs on the scheduler thread between two steps (:meth:`_run_control` of the runner).
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
        items = self._check_named_tensors(_iter_safetensors(path))
        # A checkpoint of this architecture has every parameter (tied ones under either name).
        covered = {self._params[n].data_ptr() for n, _ in items}
        missing = [n for n, p in self._params.items() if p.data_ptr() not in covered]
        if missing:
            raise ValueError(f"checkpoint {model_path!r} is missing parameter {missing[0]!r}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))

        def after():
            self.model_path = str(model_path)

        self._apply_weights(items, weight_version, after)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first ``truncate_size`` rows (dim 0) of parameter ``name`` as float32 nested lists —
        SGLang's ``/get_weights_by_name`` semantics; used by ``slimectl sync --verify``."""
        p = self._params.get(name)
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
        for name, dtype, shape in specs:
            param = self._params.get(name)
            if param is None:
                raise ValueError(f"unknown parameter name {name!r}")
            if tuple(shape) != tuple(param.shape):
                raise ValueError(f"shape mismatch for {name!r}: got {tuple(shape)}, expected {tuple(param.shape)}")
            if not dtype.is_floating_point and param.is_floating_point():
                raise ValueError(f"dtype mismatch for {name!r}: got {dtype}, expected a floating point tensor")
        if weight_version is not None and (not isinstance(weight_version, str) or not weight_version):
            raise ValueError(f"weight_version must be a non-empty string, got {weight_version!r}")

        def apply():
            try:
                with torch.no_grad():
                    for name, dtype, shape in specs:
                        p = self._params[name]
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

    def _check_named_tensors(self, named_tensors) -> list[tuple[str, torch.Tensor]]:
        items = []
        for entry in named_tensors:
            try:
                name, tensor = entry
            except (TypeError, ValueError):
                raise ValueError("named_tensors must be (name, tensor) pairs") from None
            param = self._params.get(name)
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

        def apply():
            with torch.no_grad():
                for name, tensor in items:
                    p = self._params[name]
                    p.copy_(tensor.to(device=p.device, dtype=p.dtype))
            if after is not None:
                after()
            if weight_version is not None:
                self._weight_version = weight_version

        self._run_control(apply)


def _iter_safetensors(path: Path):
    """(name, tensor) for every tensor of a checkpoint directory (the one reader in backends/hf);
    its errors become ValueError, which the server answers with HTTP 400."""
    from slimectl.backends.hf.checkpoint import iter_safetensors_dir
    from slimectl.contract.errors import SlimectlError

    try:
        yield from iter_safetensors_dir(path)
    except SlimectlError as exc:
        raise ValueError(str(exc)) from None
