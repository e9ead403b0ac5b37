"""Load slimectl Megatron checkpoints at the TP/PP of this launch and compare their logits with
the HF models' on the same tokens. Prints one RESULT JSON line per checkpoint. Run with python
or torchrun.

    [torchrun --nproc_per_node N] mcore_logits.py TP PP CKPT_ROOT HF_DIR [CKPT_ROOT HF_DIR ...]

HF's logits come from transformers in this process, or, when SLIMECTL_TEST_HF_LOGITS names a file
written by :func:`write_hf_logits` (by the test, in its own process, where transformers is imported
already) holding HF's logits for this HF_DIR and these very token ids, from that file: a rank then
never imports transformers (~7 CPU-s per rank and launch).
"""

import json
import os
import sys

import torch


def main() -> None:
    tp, pp, pairs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    from slimectl.backends.megatron.parallel import init_parallel, shutdown_parallel

    info = init_parallel(tp=tp, pp=pp)
    for ckpt, hf_dir in zip(pairs[::2], pairs[1::2]):
        compare(info, ckpt, hf_dir, tp, pp)
    shutdown_parallel()


def compare(info, ckpt, hf_dir, tp, pp) -> None:
    from slimectl.backends.megatron.checkpoint import arch_from_meta, load_megatron_checkpoint, read_checkpoint_meta
    from slimectl.backends.megatron.provider import build_gpt_model

    meta, it_dir, _ = read_checkpoint_meta(ckpt)
    arch = arch_from_meta(meta)
    model = build_gpt_model(arch, meta["padded_vocab_size"], tp=tp, pp=pp, init=False).eval()
    load_megatron_checkpoint(model, it_dir)
    B, S = 2, 24
    ids = draw_ids(arch.vocab_size, B, S, seed=7)
    logits = forward_logits(model, ids)
    result = {"rank": info.rank, "tp": tp, "pp": pp, "ckpt": ckpt}
    if info.is_last_stage and info.tp_rank == 0:
        result.update(hf_diff(hf_dir, ids, logits, arch.vocab_size))
        print("RESULT " + json.dumps(result), flush=True)


def forward_logits(model, ids):
    """The model's logits for IDS (B, S) through Megatron's pipeline schedule, gathered over TP (last
    pipeline stage; None on the others)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    B, S = ids.shape
    pos = torch.arange(S).expand(B, S)
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
    return outputs[0] if outputs else None


def draw_ids(vocab_size: int, B: int, S: int, seed: int) -> torch.Tensor:
    """The token ids a comparison feeds (the same in every rank and in :func:`write_hf_logits`)."""
    return torch.randint(0, vocab_size, (B, S), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf_dir, ids) -> tuple[torch.Tensor, str]:
    """HF's fp32 logits for IDS: from SLIMECTL_TEST_HF_LOGITS when it holds this model and these ids,
    else computed with transformers here. Also says which."""
    path = os.environ.get("SLIMECTL_TEST_HF_LOGITS")
    if path and os.path.isfile(path):
        for d, ref_ids, ref in torch.load(path, weights_only=True):
            if d == os.path.abspath(hf_dir) and torch.equal(ref_ids, ids):
                return ref, "file"
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits, "transformers"


def write_hf_logits(path, hf_dirs, draws) -> None:
    """PATH: HF's logits (transformers, fp32) of each HF dir on draw_ids(vocab, B, S, seed) for each
    (B, S, seed) in DRAWS, for the ranks' :func:`hf_logits` (run in the test's process)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    refs = []
    for d in hf_dirs:
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        for B, S, seed in draws:
            ids = draw_ids(AutoConfig.from_pretrained(d).vocab_size, B, S, seed)
            with torch.no_grad():
                refs.append((os.path.abspath(d), ids, hf(ids).logits))
    torch.save(refs, path)


def hf_diff(hf_dir, ids, logits, vocab_size: int) -> dict:
    """max |Megatron - HF| over the real vocabulary, the HF logits' scale and the padded vocabulary."""
    ref, source = hf_logits(hf_dir, ids)
    got = logits[..., :vocab_size]
    return {"max_abs_diff": (got - ref).abs().max().item(), "scale": ref.abs().max().item(),
            "padded_vocab": int(logits.shape[-1]), "hf_logits_from": source}


if __name__ == "__main__":
    main()
