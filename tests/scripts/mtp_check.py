"""A model with multi-token-prediction layers on the Megatron actor at the TP/EP of this launch: the HF checkpoint
loaded, read back through the sync path (TP shards gathered, experts from every expert-parallel rank) and compared
bit for bit with the file; then, at TP 1 (megatron-core trains MoE layers under TP with sequence parallelism only),
one GRPO step with ``train.mtp`` (its MTP loss, which tensors moved). One RESULT
JSON line from global rank 0. Run with python or torchrun (data-parallel = world / tp).

    [torchrun --nproc_per_node N] mtp_check.py TP EP HF_DIR
"""

import json
import math
import sys


def main() -> None:
    tp, ep, hf_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.megatron.actor import MegatronActor
    from slimectl.backends.megatron.parallel import init_parallel, shutdown_parallel
    from slimectl.contract.config_schema import AlgorithmSection, MtpSection, TrainSection
    from slimectl.contract.samples import Sample

    info = init_parallel(tp=tp, ep=ep)
    arch = arch_from_dir(hf_dir)
    train = TrainSection(tp=tp, dp=info.world_size // tp, ep=ep, lr=1e-2, max_tokens_per_micro_batch=40,
                         mtp=MtpSection(num_layers=arch.mtp_layers))
    a = MegatronActor(arch, arch.padded_vocab_size(tp), train, AlgorithmSection(), tp=tp, ep=ep)
    a.load_hf(hf_dir)
    before = a.hf_state_dict()
    g = torch.Generator().manual_seed(11)
    samples = [Sample(index=i, group_index=i // 2, tokens=torch.randint(0, arch.vocab_size, (p + r,), generator=g).tolist(),
                      response_length=r, reward=float(i % 2))
               for i, (p, r) in enumerate([(8, 12), (4, 6), (10, 12), (3, 5), (6, 9), (4, 6), (5, 7), (7, 5)])]
    m = a.train_on_samples(samples)[0] if tp == 1 else {"train/loss": 0.0}
    after = a.hf_state_dict()
    if dist.get_rank() == 0:
        hf = load_file(f"{hf_dir}/model.safetensors")
        mtp = [n for n in hf if n.startswith(f"model.layers.{arch.num_layers}.")]
        moved = sorted(n for n in mtp if not torch.equal(before[n], after[n]))
        print("RESULT " + json.dumps({
            "tp": tp, "ep": ep, "names_equal": sorted(before) == sorted(hf),
            "bit_exact": sorted(n for n in hf if n in before and not torch.equal(before[n], hf[n])) == [],
            "mtp_tensors": len(mtp), "mtp_moved": moved,
            "mtp_loss": m.get("train/mtp_loss", math.nan), "loss_finite": math.isfinite(m["train/loss"])}),
            flush=True)
    shutdown_parallel()


if __name__ == "__main__":
    main()
