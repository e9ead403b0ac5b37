"""PPO's value model on megatron-core: the actor's GPTModel trunk with a ``hidden -> 1`` value head.

The trunk is :func:`slimectl.backends.megatron.provider.build_gpt_model` (same transformer config,
same local layer spec and packed-sequence attention as the actor), with its output layer (the
vocabulary head) removed; the value head is a plain ``torch.nn.Linear(hidden, 1)`` on the last
pipeline stage, replicated on every tensor-parallel rank (its input, the final normed hidden states,
is the same on every TP rank, so the replicas compute and receive the same values and gradients).
It starts at zero weight and bias: the first values are exactly 0 for every TP/PP layout, and the
trunk is exactly the actor's (:func:`load_trunk_from_hf` fills it from the actor's HF checkpoint).

Positions: the value of response token ``i`` of a packed sequence is read at row
``start + prompt_length + i - 1`` — the position whose logits predict that token (the rows the
actor's log-probs use, :func:`slimectl.backends.megatron.logprobs.response_positions`), i.e. the
value of the state in which token ``i`` is chosen. This is slime's ``get_values`` layout.

What is here: the model, its initialisation from the actor's weights, its torch_dist view
(:meth:`ValueModel.sharded_state_dict`), per-sequence and padded ``[B, T]`` values of packed
micro-batches. The optimizer, LR schedule, training loop and checkpoints are
:mod:`slimectl.backends.megatron.critic_trainer`'s.
"""

from __future__ import annotations

import torch

import slimectl.backends.megatron  # noqa: F401  (quiets megatron's import-time notices about missing TE/Apex)
from slimectl.backends.megatron.packing import MicroBatch


class ValueModel(torch.nn.Module):
    """GPTModel trunk (no vocabulary head) + value head; ``forward`` returns ``[S, B]`` values on the last
    pipeline stage and the hidden states ``[S, B, H]`` on the others."""

    # Read by megatron-core's finalize_model_grads through the wrapper: no embedding is shared with an
    # output layer here (there is none), so no first/last-stage embedding all-reduce.
    share_embeddings_and_output_weights = False

    def __init__(self, gpt, hidden_size: int, params_dtype: torch.dtype):
        super().__init__()
        gpt.output_layer = None  # the vocabulary head: a value model never computes logits
        gpt.share_embeddings_and_output_weights = False
        self.gpt = gpt
        self.pre_process, self.post_process = gpt.pre_process, gpt.post_process
        # read by Megatron's pipeline schedule and finalize_model_grads through the DDP wrapper
        self.model_type, self.config = gpt.model_type, gpt.config
        self.value_head = None
        if gpt.post_process:
            head = torch.nn.Linear(hidden_size, 1, bias=True, dtype=params_dtype)
            torch.nn.init.zeros_(head.weight)
            torch.nn.init.zeros_(head.bias)
            self.value_head = head

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """torch_dist's view of the model (reshardable: TP/PP/DP as the actor's): the trunk's GPTModel
        tensors under ``gpt.``, the value head (last stage, replicated over TP) under ``value_head.``."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, sharded_state_dict_default

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        saved = self.gpt.post_process
        self.gpt.post_process = False  # Megatron's LanguageModule would mark the (removed) output layer's tensor
        try:
            out = self.gpt.sharded_state_dict(prefix=f"{prefix}gpt.", sharded_offsets=sharded_offsets,
                                              metadata=metadata)
        finally:
            self.gpt.post_process = saved
        if self.value_head is not None:
            out.update(sharded_state_dict_default(self.value_head, f"{prefix}value_head.", sharded_offsets, metadata,
                                                  tp_group=ps.get_tensor_model_parallel_group()))
        return out

    def set_input_tensor(self, input_tensor) -> None:
        """Megatron's pipeline schedule hands a non-first stage its input through this."""
        self.gpt.set_input_tensor(input_tensor)

    def hidden_states(self, input_ids, position_ids, attention_mask=None) -> torch.Tensor:
        """The trunk's output ``[S, B, H]`` (final normed hidden states on the last stage)."""
        saved = self.gpt.post_process
        self.gpt.post_process = False  # GPTModel stops before its (removed) output layer
        try:
            return self.gpt(input_ids, position_ids, attention_mask)
        finally:
            self.gpt.post_process = saved

    def forward(self, input_ids, position_ids, attention_mask=None) -> torch.Tensor:
        h = self.hidden_states(input_ids, position_ids, attention_mask)
        if self.value_head is None:
            return h
        return self.value_head(h).squeeze(-1)


def build_value_model(arch, padded_vocab: int, tp: int = 1, pp: int = 1, dtype: str = "fp32",
                      init: bool = True) -> ValueModel:
    """This rank's value model (Megatron's parallel state must be initialised: ``init_parallel``)."""
    from slimectl.backends.megatron.provider import build_gpt_model, transformer_config

    gpt = build_gpt_model(arch, padded_vocab, tp=tp, pp=pp, dtype=dtype, init=init)
    return ValueModel(gpt, arch.hidden_size, transformer_config(arch, tp, pp, dtype, init=False).params_dtype)


def load_trunk_from_hf(model: ValueModel, arch, hf_dir, padded_vocab: int, tp_rank: int = 0, tp: int = 1) -> int:
    """Fill the trunk from an HF checkpoint directory (the actor's ``model.path``, or ``critic.path``);
    the LM head there is not read. The value head keeps its zeros. Returns the tensors filled."""
    from slimectl.backends.hf.checkpoint import HFCheckpoint
    from slimectl.backends.megatron.checkpoint import load_hf_into_model

    return load_hf_into_model(model.gpt, arch, HFCheckpoint(str(hf_dir)), padded_vocab, tp_rank, tp)


def forward_values(model, micro_batch: MicroBatch) -> torch.Tensor:
    """The model's output for one packed micro-batch (values ``[L]`` on the last stage, hidden states
    elsewhere); attention causal per packed sequence, as the actor's."""
    from slimectl.backends.megatron.attention import packed_segments

    device = next(model.parameters()).device
    with packed_segments(micro_batch.segment_lengths):
        out = model(micro_batch.input_ids.to(device), micro_batch.position_ids.to(device), None)
    return out[:, 0] if out.dim() == 2 else out


def response_rows(values: torch.Tensor, micro_batch: MicroBatch) -> list[torch.Tensor]:
    """``[L]`` values of a packed micro-batch -> per packed sequence (in ``micro_batch.seqs`` order) the values
    of its response tokens ``[response_length]``."""
    from slimectl.backends.megatron.logprobs import response_positions

    rows, _, counts = response_positions(micro_batch)
    return list(values.index_select(0, rows.to(values.device)).split(counts))
