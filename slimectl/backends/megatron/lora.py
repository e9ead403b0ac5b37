"""LoRA adapters on megatron-core's tensor-parallel linears: added, frozen base, TP-sharded, saved, read as PEFT.

Each targeted PEFT module (``q_proj`` ... ``down_proj``) gets ``A`` [r, in] and ``B`` [out, r] and adds
``alpha/r * B (A dropout(x))`` to its linear's output (a forward hook on the linear: the base parameters keep
their names, so the HF mapping, the engines and the full-weight paths are untouched). Megatron fuses what HF
keeps apart, so one linear may carry several adapters:

- ``linear_qkv`` (column-parallel) = q, k, v interleaved per query group: each projection's delta is computed
  on its own and interleaved the same way; a TP rank holds whole groups, so each ``B`` is split by rows
  (contiguous in HF's order) and ``A`` is replicated.
- ``linear_fc1`` (column-parallel) = ``[gate_r; up_r]`` on TP rank r: the same, ``B`` split by rows.
- ``linear_proj`` / ``linear_fc2`` (row-parallel, ``o_proj`` / ``down_proj``): the input is split, so ``A``
  is split by columns and its partial product all-reduced before the replicated ``B``.

The mappings are megatron's autograd-aware ones (identity forward / all-reduce backward and back), so the
gradients equal TP=1's. ``A`` starts as PEFT's (kaiming-uniform, the full tensor drawn from a generator seeded
by the layer and module, then sliced: the same at every TP size), ``B`` at zero: step 0 is the base model.
Adapter names here are PEFT's (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from slimectl.backends.hf.arch import ModelArch
from slimectl.backends.hf.peft_adapter import HF_MODULES, module_shapes, peft_name
from slimectl.contract.errors import UsageError

#: PEFT module -> the Megatron linear holding it
LINEAR_OF = {"q_proj": "self_attention.linear_qkv", "k_proj": "self_attention.linear_qkv",
             "v_proj": "self_attention.linear_qkv", "o_proj": "self_attention.linear_proj",
             "gate_proj": "mlp.linear_fc1", "up_proj": "mlp.linear_fc1", "down_proj": "mlp.linear_fc2"}
#: The projections each linear fuses, in its layout's order.
FUSED = {"self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"), "self_attention.linear_proj": ("o_proj",),
         "mlp.linear_fc1": ("gate_proj", "up_proj"), "mlp.linear_fc2": ("down_proj",)}
ROW_PARALLEL = ("self_attention.linear_proj", "mlp.linear_fc2")


def check_lora_targets(arch: ModelArch, modules: tuple[str, ...]) -> None:
    """MoE layers' MLPs are experts: LoRA there is not supported (one line naming the fix)."""
    if arch.is_mla:
        raise UsageError(f"train.lora: {arch.family} has multi-latent attention (q_a_proj, kv_b_proj, ...), whose "
                         f"projections LoRA does not adapt here; train it without LoRA (remove train.lora)")
    mlp = [m for m in modules if m in ("gate_proj", "up_proj", "down_proj")]
    if arch.is_moe and mlp:
        raise UsageError(f"train.lora.target_modules: {', '.join(mlp)} of an MoE model are its experts, which "
                            f"LoRA does not adapt here; target the attention only: [q_proj, k_proj, v_proj, o_proj]")


class LinearAdapters(torch.nn.Module):
    """The adapters of one Megatron linear (one per fused projection targeted); see the module docstring."""

    def __init__(self, linear_path: str, layer: int, arch: ModelArch, lora, modules: tuple[str, ...],
                 tp_rank: int, tp: int, seed: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.linear_path, self.layer, self.arch = linear_path, layer, arch
        self.row = linear_path in ROW_PARALLEL
        self.parts = FUSED[linear_path]
        self.scale, self.enabled = lora.scale, True
        self.dropout = torch.nn.Dropout(lora.dropout) if lora.dropout > 0 else torch.nn.Identity()
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        self.out_local = {}
        for m in self.parts:
            out, inp = module_shapes(arch, m)
            self.out_local[m] = out if self.row else out // tp
            if m not in modules:
                continue
            a = _kaiming_uniform((lora.rank, inp), seed, layer, m)
            a = a.chunk(tp, dim=1)[tp_rank] if self.row else a
            b = torch.zeros(out if self.row else out // tp, lora.rank)
            # the base's dtype: under bf16 Megatron's optimizer keeps fp32 main copies of them as of the base
            self.A[m], self.B[m] = (torch.nn.Parameter(t.to(dtype).contiguous()) for t in (a, b))
            if tp > 1:  # which of them are split (grad norms count the replicated ones once)
                sharded, dim = (self.A[m], 1) if self.row else (self.B[m], 0)
                set_tensor_model_parallel_attributes(sharded, True, dim, 1)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """What the adapters add to the linear's (local) output for its input ``x`` [s, b, in_local]."""
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        x = self.dropout(x)
        outs = []
        for m in self.parts:
            if m not in self.A:
                outs.append(x.new_zeros(x.shape[:-1] + (self.out_local[m],)))
                continue
            h = x @ self.A[m].t()
            # column: A replicated (its gradient all-reduced by the copy); row: A's partial products summed
            h = reduce_from_tensor_model_parallel_region(h) if self.row else copy_to_tensor_model_parallel_region(h)
            outs.append((h @ self.B[m].t()) * self.scale)
        if len(outs) == 1:
            return outs[0]
        if self.linear_path == "mlp.linear_fc1":
            return torch.cat(outs, dim=-1)
        return _interleave_qkv(outs, self.arch)

    def hook(self, _linear, inputs, output):
        if not self.enabled:
            return output
        out, bias = output
        return out + self.delta(inputs[0]).to(out.dtype), bias


def _release_after_training_layer(layer, _inputs, _output):
    if layer.training:
        from slimectl.backends.host_memory import release_free_memory

        release_free_memory()


def _requires_grad(_module, _inputs, output):
    return output.requires_grad_(True) if not output.requires_grad else output


def _kaiming_uniform(shape: tuple[int, int], seed: int, layer: int, module: str) -> torch.Tensor:
    """PEFT's A init (``kaiming_uniform_(a=sqrt(5))``: U(-1/sqrt(in), 1/sqrt(in))), the full tensor from a
    generator of its own (the same at every TP size and on every rank)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + layer * 101 + list(HF_MODULES).index(module))
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=gen) * 2 - 1) * bound


def _interleave_qkv(parts: list[torch.Tensor], arch: ModelArch) -> torch.Tensor:
    """q, k, v deltas [..., g*n*d], [..., g*d], [..., g*d] in ``linear_qkv``'s per-group layout."""
    q, k, v = parts
    d, n = arch.head_dim, arch.q_per_group
    g = k.shape[-1] // d
    lead = q.shape[:-1]
    fused = torch.cat([q.reshape(lead + (g, n * d)), k.reshape(lead + (g, d)), v.reshape(lead + (g, d))], dim=-1)
    return fused.reshape(lead + (g * (n + 2) * d,))


@dataclass
class Adapted:
    """One adapted linear of this stage: its adapters, the global layer, its hook's handle."""

    adapters: LinearAdapters
    layer: int
    handle: object


class LoraModel:
    """The adapters of a GPTModel stage (see the module docstring): added by :meth:`attach`, the base frozen."""

    def __init__(self, items: list[Adapted], arch: ModelArch, lora, tp_rank: int, tp: int):
        self.items, self.arch, self.lora, self.tp_rank, self.tp = items, arch, lora, tp_rank, tp

    @classmethod
    def attach(cls, gpt, arch: ModelArch, lora, tp_rank: int, tp: int, seed: int) -> "LoraModel":
        """Freeze every parameter of ``gpt`` and add the adapters ``lora`` (a ``LoraSection``) names to its layers
        (before DDP wraps it: DDP then holds the adapters only)."""
        modules = lora.modules
        check_lora_targets(arch, modules)
        gpt.requires_grad_(False)
        linears = sorted({LINEAR_OF[m] for m in modules}, key=list(FUSED).index)
        items = []
        for layer in gpt.decoder.layers:
            i = layer.layer_number - 1
            for path in linears:
                linear = layer.get_submodule(path)
                adapters = LinearAdapters(path, i, arch, lora, modules, tp_rank, tp, seed, linear.weight.dtype)
                linear.add_module("lora", adapters)
                items.append(Adapted(adapters, i, linear.register_forward_hook(adapters.hook)))
        for layer in gpt.decoder.layers:
            # A LoRA step's peak is the frozen base plus the heap the layers' temporaries leave behind: freed
            # blocks go back to the OS after each layer of a training forward (and of its recompute)
            layer.register_forward_hook(_release_after_training_layer)
        if getattr(gpt, "embedding", None) is not None:
            # The frozen embedding's output does not require grad, so a recomputed layer (an autograd Function
            # over its inputs) would have no backward: the adapters inside it get their gradient through this.
            gpt.embedding.register_forward_hook(_requires_grad)
        return cls(items, arch, lora, tp_rank, tp)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for it in self.items:
            yield from it.adapters.parameters()

    def num_parameters(self) -> int:
        """This rank's adapter elements."""
        return sum(p.numel() for p in self.parameters())

    @contextlib.contextmanager
    def disabled(self):
        """The base model: every adapter off (KL's reference log-probs)."""
        for it in self.items:
            it.adapters.enabled = False
        try:
            yield
        finally:
            for it in self.items:
                it.adapters.enabled = True

    def _matrices(self) -> Iterator[tuple[str, torch.nn.Parameter, int | None]]:
        """(PEFT name, this rank's parameter, the dim it is split along under TP or None)."""
        for it in self.items:
            a = it.adapters
            for m in a.A:
                yield peft_name(it.layer, m, "A"), a.A[m], (1 if a.row and self.tp > 1 else None)
                yield peft_name(it.layer, m, "B"), a.B[m], (0 if not a.row and self.tp > 1 else None)

    # ------------------------------------------------------------------ checkpoints (torch_dist)
    def sharded_state_dict(self) -> dict:
        """The adapters as torch_dist sharded tensors keyed by their PEFT names (the live parameters)."""
        from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

        out = {}
        for name, p, dim in self._matrices():
            out[name] = make_sharded_tensor_for_checkpoint(p, name) if dim is None else \
                make_tp_sharded_tensor_for_checkpoint(p, name, tp_axis=dim)
        return out

    def load_state_dict(self, loaded: dict) -> list[str]:
        """Copy what :meth:`sharded_state_dict`'s request loaded into the adapters; returns missing names."""
        missing = []
        with torch.no_grad():
            for name, p, _ in self._matrices():
                if name in loaded:
                    p.copy_(loaded[name])
                else:
                    missing.append(name)
        return missing

    # ------------------------------------------------------------------ PEFT tensors
    def peft_tensors(self, tp_group=None) -> Iterator[tuple[str, torch.Tensor]]:
        """(PEFT name, full tensor) of this stage's adapters (collective under TP: every rank iterates)."""
        import torch.distributed as dist

        for name, p, dim in self._matrices():
            t = p.detach()
            if dim is not None:
                shards = [torch.empty_like(t) for _ in range(self.tp)]
                dist.all_gather(shards, t.contiguous(), group=tp_group)
                t = torch.cat(shards, dim=dim)
            yield name, t

    def load_peft(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        """Fill the adapters from a PEFT adapter's full tensors (this rank's shards of them); every name and shape
        is checked first (a one-line error naming ``where``)."""
        plan = []
        for name, p, dim in self._matrices():
            if name not in tensors:
                raise UsageError(f"{where}: the adapter does not fit model.path (it lacks {name}); use an adapter "
                                 f"trained on model.path with train.lora's rank and target modules")
            t = tensors[name]
            local = t.chunk(self.tp, dim=dim)[self.tp_rank] if dim is not None else t
            if tuple(local.shape) != tuple(p.shape):
                mine = list(p.shape) if dim is None else "a shard of another shape"
                raise UsageError(f"{where}: the adapter does not fit model.path ({name} is {list(t.shape)}, this "
                                 f"model's is {mine}); use an adapter trained on model.path with train.lora's rank "
                                 f"and target modules")
            plan.append((p, local))
        with torch.no_grad():
            for p, local in plan:
                p.copy_(local)


def read_checkpoint_adapters(it_dir, arch: ModelArch, cfg: dict) -> dict[str, torch.Tensor]:
    """The full adapter tensors a LoRA run's torch_dist checkpoint holds (saved at any TP/PP), by PEFT name;
    ``cfg``: the adapter config its metadata records. One process, Megatron's parallel state set up."""
    from megatron.core import dist_checkpointing
    from megatron.core.utils import make_sharded_tensor_for_checkpoint

    from slimectl.backends.megatron.safe_loading import install_safe_loading

    install_safe_loading()
    request = {}
    for layer in range(arch.num_layers):
        for m in cfg["target_modules"]:
            out, inp = module_shapes(arch, m)
            for which, shape in (("A", (cfg["r"], inp)), ("B", (out, cfg["r"]))):
                name = peft_name(layer, m, which)
                request[name] = make_sharded_tensor_for_checkpoint(torch.empty(shape), name)
    loaded = dist_checkpointing.load({"model": request}, str(it_dir))
    return dict(loaded["model"])
