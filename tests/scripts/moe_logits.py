"""Load slimectl Megatron checkpoints of MoE models at the TP/PP/EP of this launch and compare their
logits with the HF models' on the same tokens; also report this rank's local experts. One RESULT
JSON line per checkpoint (from the last stage's TP rank 0). Run with python or torchrun.

    [torchrun --nproc_per_node N] moe_logits.py TP PP EP CKPT_ROOT HF_DIR [CKPT_ROOT HF_DIR ...]
"""

import json
import sys

import torch


def main() -> None:
    tp, pp, ep, pairs = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    from slimectl.backends.megatron.parallel import init_parallel, shutdown_parallel

    info = init_parallel(tp=tp, pp=pp, ep=ep)
    for ckpt, hf_dir in zip(pairs[::2], pairs[1::2]):
        compare(info, ckpt, hf_dir, tp, pp, ep)
    shutdown_parallel()


def compare(info, ckpt, hf_dir, tp, pp, ep) -> None:
    import torch.distributed as dist

    from slimectl.backends.megatron.checkpoint import arch_from_meta, load_megatron_checkpoint, read_checkpoint_meta
    from slimectl.backends.megatron.provider import build_gpt_model, global_param_names

    meta, it_dir, _ = read_checkpoint_meta(ckpt)
    arch = arch_from_meta(meta)
    model = build_gpt_model(arch, meta["padded_vocab_size"], tp=tp, pp=pp, init=False).eval()
    load_megatron_checkpoint(model, it_dir)
    experts = sorted({int(g.split("local_experts.")[1].split(".")[0])
                      for g in global_param_names(model).values() if "local_experts." in g})
    # Data-parallel ranks (the expert-parallel ones among them) feed different tokens and lengths:
    # their MoE layers exchange unequal token counts, as in training on packed micro-batches.
    B, S = 2, 24 - 5 * info.dp_rank
    ids = torch.randint(0, arch.vocab_size, (B, S), generator=torch.Generator().manual_seed(7 + info.dp_rank))
    pos = torch.arange(S).expand(B, S)
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    outputs = []

    def forward_step(data_iterator, model):
        out = model(ids, pos, None)

        def collect(output_tensor, non_loss_data=False):
            outputs.append(gather_from_tensor_model_parallel_region(output_tensor.detach()))
            return torch.zeros(()), {}

        return out, collect

    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
            seq_length=S, micro_batch_size=B, forward_only=True, collect_non_loss_data=True,
        )
    all_experts = [None] * dist.get_world_size()
    dist.all_gather_object(all_experts, experts)
    result = {"rank": info.rank, "tp": tp, "pp": pp, "ep": ep, "ckpt": ckpt, "experts_per_rank": all_experts,
              "seq_len": S}
    if info.is_last_stage and info.tp_rank == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = hf(ids).logits
        got = outputs[0][..., : arch.vocab_size]
        result.update(max_abs_diff=(got - ref).abs().max().item(), scale=ref.abs().max().item(),
                      padded_vocab=int(outputs[0].shape[-1]))
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
