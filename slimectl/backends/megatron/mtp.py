"""Multi-token-prediction (MTP) layers on the Megatron actor: megatron-core's ``MultiTokenPredictionBlock`` built beside
the GPTModel, its expert names, which of its parameters train, and its loss (``train.mtp``).

The block is the model's ``mtp`` submodule on the last pipeline stage (``mtp.layers.{k}.``: ``enorm``, ``hnorm``,
``eh_proj``, ``transformer_layer`` — an MoE decoder layer like the last — and ``final_layernorm``; HF names in
``slimectl.backends.hf.mtp``), so it is converted, checkpointed, exported and synced with the model. GPTModel does
not run it (its ``mtp_process`` is off): with ``train.mtp.num_layers > 0`` :func:`mtp_loss` runs it on each
training micro-batch, otherwise it is frozen (no gradient, no optimizer state: exported as it came in).

As slime trains it (``--enable-mtp-training``; its Megatron patch detaches the MTP layer's embedding input and the
main model's hidden states, and uses a detached LM head; ``ci_utils.check_mtp_only_grad``), the MTP loss reaches
the MTP layers only: MTP layer ``k`` at position ``i`` reads the main model's final hidden state (its norm's output)
and the embedding of token ``i + k + 1`` and predicts token ``i + k + 2``; the loss is its cross entropy over the
response tokens (slime's ``full_loss_masks`` rolled), the mean over a micro-batch's predicted tokens, per layer
scaled by ``loss_scale / num_layers`` (megatron-core's ``mtp_loss_scaling_factor / mtp_num_layers``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from slimectl.backends.hf.mtp import MEGATRON_PREFIX, check_mtp_training

_EXPERTS = "mlp.experts.local_experts."


def build_mtp_block(gpt, cfg, layer_spec, num_layers: int) -> None:
    """Give ``gpt`` (the last pipeline stage's GPTModel, built without MTP) megatron-core's block of
    ``num_layers`` MTP layers as ``gpt.mtp``, each with ``layer_spec``'s decoder layer (the local spec; a
    ``TransformerBlockSubmodules``: its last layer's)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    mtp_cfg = copy.copy(cfg)  # the model's config says no MTP: GPTModel's forward never runs the block
    mtp_cfg.mtp_num_layers = num_layers
    spec = get_gpt_mtp_block_spec(mtp_cfg, layer_spec, use_transformer_engine=False)
    gpt.mtp = MultiTokenPredictionBlock(config=mtp_cfg, spec=spec)


def mtp_block(model):
    """The MTP block of a (wrapped) GPTModel, or None."""
    from slimectl.backends.megatron.logprobs import gpt_model

    return getattr(gpt_model(model), "mtp", None)


def freeze_unless_trained(gpt, num_layers: int, arch) -> None:
    """``train.mtp.num_layers``: refuse more layers than the checkpoint has (one line); with 0 the MTP layers get
    no gradient and no optimizer state (slime without ``--enable-mtp-training`` never runs them)."""
    check_mtp_training(arch, num_layers)
    block = getattr(gpt, "mtp", None)
    if block is not None and not num_layers:
        block.requires_grad_(False)


def global_mtp_name(model, local: str) -> str:
    """An MTP parameter's global name: under expert parallelism each rank numbers its local experts from 0,
    ``local_experts.J`` becomes the global expert index (as the decoder layers' are)."""
    head = f"{MEGATRON_PREFIX}"
    rest = local[len(head):]
    k, tail = rest.split(".", 1)
    inner = "transformer_layer." + _EXPERTS
    if not tail.startswith(inner):
        return local
    e, after = tail[len(inner):].split(".", 1)
    mlp = mtp_block(model).layers[int(k)].transformer_layer.mlp
    first = (getattr(mlp, "local_expert_indices", None) or [0])[0]
    return f"{head}{k}.{inner}{first + int(e)}.{after}"


@dataclass
class MtpTargets:
    """Where a micro-batch's MTP layer ``k`` is scored: the rows of its output and the tokens they predict."""

    rows: torch.Tensor
    targets: torch.Tensor


def mtp_targets(micro_batch, depth: int) -> MtpTargets:
    """Rows ``i`` of the packed row whose token ``i + depth + 1`` (``depth`` from 1) is a response token of the same
    sequence: what MTP layer ``depth - 1`` predicts there (slime's loss mask: the response tokens)."""
    rows, tgt = [], []
    for s in micro_batch.seqs:
        first, r = s.first_response_row, s.response_length
        lo = max(first, s.start + depth + 1)  # the first predicted token with a row of its own sequence before it
        if r and first + r > lo:
            t = torch.arange(lo, first + r)
            rows.append(t - depth - 1)
            tgt.append(t)
    ids = micro_batch.input_ids[0]
    if not rows:
        return MtpTargets(torch.zeros(0, dtype=torch.long), ids[:0])
    return MtpTargets(torch.cat(rows), ids[torch.cat(tgt)])


def mtp_hidden_states(model, hidden: torch.Tensor, micro_batch, num_layers: int) -> tuple[torch.Tensor, ...]:
    """Each MTP layer's output ``[S, 1, H]`` (after its final norm: the LM head's input) for ``micro_batch``, from
    the main model's final hidden states ``hidden`` (detached here); row ``i`` of layer ``k`` predicts token
    ``i + k + 2`` (rows near a sequence's end read the next sequence's tokens: :func:`mtp_targets` never scores
    them). Rotary by row, as the main forward (attention is causal within each packed sequence)."""
    from slimectl.backends.megatron.attention import packed_segments
    from slimectl.backends.megatron.logprobs import gpt_model

    gpt = gpt_model(model)
    device = hidden.device
    ids = micro_batch.input_ids.to(device)
    positions = micro_batch.position_ids.to(device)

    def embedding(input_ids, position_ids):  # slime: the MTP layer's token embeddings carry no gradient
        return gpt.embedding(input_ids=input_ids, position_ids=position_ids).detach()

    rope = gpt.rotary_pos_emb(ids.shape[1]) if getattr(gpt, "rotary_pos_emb", None) is not None else None
    with packed_segments(micro_batch.layout):
        out = gpt.mtp(input_ids=ids, position_ids=positions, hidden_states=hidden.detach(), attention_mask=None,
                      rotary_pos_emb=rope, embedding=embedding)
    return out.chunk(1 + num_layers, dim=0)[1:]


def mtp_loss(model, hidden: torch.Tensor, micro_batch, vocab_size: int, num_layers: int, loss_scale: float,
             tp_group=None) -> tuple[torch.Tensor, float]:
    """(the loss to add for ``micro_batch``: each MTP layer's mean cross entropy times ``loss_scale / num_layers``;
    the unscaled sum over the layers of their mean cross entropy, for ``train/mtp_loss``). ``hidden``: the main
    model's final hidden states ``[S, 1, H]``. Shared-prompt rows never come here (the actor packs without)."""
    from slimectl.backends.megatron.logprobs import log_probs_from_rows, output_weight

    weight = output_weight(model).detach()  # slime: the MTP loss does not train the LM head
    total, logged = hidden.new_zeros((), dtype=torch.float32), 0.0
    for k, h in enumerate(mtp_hidden_states(model, hidden, micro_batch, num_layers)):
        where = mtp_targets(micro_batch, k + 1)
        if where.rows.numel() == 0:
            total = total + h.sum() * 0.0  # the MTP layers still join the backward (DDP waits for their grads)
            continue
        lp, _ = log_probs_from_rows(h, weight, where.rows, where.targets, vocab_size, tp_group)
        ce = -lp.mean()
        total = total + ce * (loss_scale / num_layers)
        logged += float(ce.detach())
    return total, logged
