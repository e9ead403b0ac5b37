"""Load slimectl Megatron checkpoints of MoE models at the TP/PP/EP of this launch and compare their
logits with the HF models' on the same tokens; also report this rank's local experts. One RESULT
JSON line per checkpoint (from the last stage's TP rank 0). Run with python or torchrun. HF's
logits as in mcore_logits.py (SLIMECTL_TEST_HF_LOGITS: precomputed by the test).

    [torchrun --nproc_per_node N] moe_logits.py TP PP EP CKPT_ROOT HF_DIR [CKPT_ROOT HF_DIR ...]
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run by path, in-process or under torchrun
from mcore_logits import draw_ids, forward_logits, hf_diff  # noqa: E402  (this folder's: one logits comparison for both)


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
    ids = draw_ids(arch.vocab_size, B, S, seed=7 + info.dp_rank)
    # Megatron keeps the MoE aux-loss scale in a class attribute whose shape its first setter picks: the
    # actor's training sets a 0-d one, the forward schedule below copies a [1] one in. A process that
    # trained an MoE actor before (the test process, a long-lived rank) would fail here without a reset.
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    logits = forward_logits(model, ids)
    all_experts = [None] * dist.get_world_size()
    dist.all_gather_object(all_experts, experts)
    result = {"rank": info.rank, "tp": tp, "pp": pp, "ep": ep, "ckpt": ckpt, "experts_per_rank": all_experts,
              "seq_len": S}
    if info.is_last_stage and info.tp_rank == 0:
        result.update(hf_diff(hf_dir, ids, logits, arch.vocab_size))
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
