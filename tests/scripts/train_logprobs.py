"""Megatron log-probs of rollout samples, packed and one-per-micro-batch, at the TP of this launch.

    [torchrun --nproc_per_node N] train_logprobs.py TP HF_DIR SAMPLES_JSON BUDGET OUT_PT

SAMPLES_JSON: [{"tokens": [...], "response_length": n}, ...]. Rank 0 writes OUT_PT (torch.save):
packed / unpacked log-probs and entropies per sample, the micro-batch layout, and the gradient of
sum(packed log-probs) w.r.t. the (gathered) word-embedding table. Prints "RESULT {json}".

Shared prompts: the samples regrouped in fours (sample i's response after sample 4*(i//4)'s prompt),
packed with ``share_prompts`` and one per micro-batch: log-probs, entropies and the embedding
gradient of both, the rows forwarded and the attention scores computed.
"""

import json
import sys
import time

import torch



def compute_log_probs_for_batches(model, micro_batches, vocab_size: int, temperature: float = 1.0,
                                  with_entropy: bool = False, tp_group=None) -> dict:
    """``backends.megatron.logprobs.compute_log_probs`` over several micro-batches, keyed by sample index."""
    from slimectl.backends.megatron.logprobs import compute_log_probs

    out: dict = {}
    for mb in micro_batches:
        for r in compute_log_probs(model, mb, vocab_size, temperature, with_entropy, tp_group):
            out[r.sample_index] = r
    return out


def main() -> None:
    tp, hf_dir, samples_json, budget, out_pt = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    t0 = time.perf_counter()
    from slimectl.backends.megatron.checkpoint import load_hf_into_model
    from slimectl.backends.megatron.parallel import init_parallel, shutdown_parallel
    from slimectl.backends.megatron.provider import build_gpt_model
    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.hf.checkpoint import HFCheckpoint
    from slimectl.contract.samples import Sample
    from slimectl.backends.megatron.logprobs import compute_log_probs
    from slimectl.backends.megatron.packing import pack_samples

    info = init_parallel(tp=tp, pp=1)
    arch = arch_from_dir(hf_dir)
    padded = arch.padded_vocab_size(tp)
    model = build_gpt_model(arch, padded, tp=tp, pp=1, init=False).eval()
    load_hf_into_model(model, arch, HFCheckpoint(hf_dir), padded, info.tp_rank, tp)
    samples = [Sample(tokens=d["tokens"], response_length=d["response_length"]) for d in json.load(open(samples_json))]
    packed = pack_samples(samples, budget)
    single = pack_samples(samples, 1)
    t_setup = time.perf_counter() - t0

    # The raw layout of Megatron's output.
    with torch.no_grad():
        mb = packed[0]
        raw_shape = list(model(mb.input_ids, mb.position_ids, mb.attention_mask).shape)
        t1 = time.perf_counter()
        lp_packed = compute_log_probs_for_batches(model, packed, arch.vocab_size, with_entropy=True)
        t_packed = time.perf_counter() - t1
        lp_single = compute_log_probs_for_batches(model, single, arch.vocab_size)

    def embedding_grad(batches):
        """d sum(log-probs) / d word embeddings (tied or input embedding), gathered over TP."""
        model.zero_grad(set_to_none=True)
        total = sum(r.log_probs.sum() for mb in batches for r in compute_log_probs(model, mb, arch.vocab_size))
        total.backward()
        emb = model.embedding.word_embeddings.weight
        grad = emb.grad.detach().clone()
        if tp > 1:
            import torch.distributed as dist
            from megatron.core import parallel_state as ps

            parts = [torch.empty_like(grad) for _ in range(tp)]
            dist.all_gather(parts, grad.contiguous(), group=ps.get_tensor_model_parallel_group())
            grad = torch.cat(parts, 0)
        return grad[: arch.vocab_size], total

    grad, total = embedding_grad(packed)

    # Shared prompts: groups of four samples with one prompt.
    from slimectl.backends.megatron.attention import SCORES

    grouped = []
    for i, s in enumerate(samples):
        head = samples[4 * (i // 4)]
        prompt = head.tokens[: len(head.tokens) - head.response_length]
        grouped.append(Sample(tokens=prompt + s.tokens[len(s.tokens) - s.response_length:],
                              response_length=s.response_length))
    shared = pack_samples(grouped, budget, share_prompts=True)
    alone = pack_samples(grouped, 1)
    with torch.no_grad():
        SCORES.reset()
        lp_shared = compute_log_probs_for_batches(model, shared, arch.vocab_size, with_entropy=True)
        shared_scores = SCORES.scores
        SCORES.reset()
        lp_alone = compute_log_probs_for_batches(model, alone, arch.vocab_size, with_entropy=True)
        alone_scores = SCORES.scores
    grad_shared, _ = embedding_grad(shared)
    grad_alone, _ = embedding_grad(alone)

    if info.rank == 0:
        n = len(samples)
        torch.save({
            "packed": [lp_packed[i].log_probs for i in range(n)],
            "entropy": [lp_packed[i].entropy for i in range(n)],
            "single": [lp_single[i].log_probs for i in range(n)],
            "layout": [mb.sample_indices for mb in packed],
            "padding_fraction": [mb.padding_fraction for mb in packed],
            "grad": grad,
            "total": float(total.detach()),
            "shared": [lp_shared[i].log_probs for i in range(n)],
            "shared_entropy": [lp_shared[i].entropy for i in range(n)],
            "alone": [lp_alone[i].log_probs for i in range(n)],
            "alone_entropy": [lp_alone[i].entropy for i in range(n)],
            "shared_layout": [list(mb.groups) for mb in shared],
            "grad_shared": grad_shared,
            "grad_alone": grad_alone,
        }, out_pt)
        print("RESULT " + json.dumps({
            "tp": tp, "raw_logits_shape": raw_shape, "packed_len": packed[0].length, "padded_vocab": padded,
            "vocab_size": arch.vocab_size, "micro_batches": len(packed), "setup_s": round(t_setup, 2),
            "packed_logprob_s": round(t_packed, 3),
            "shared_rows": sum(mb.num_tokens for mb in shared), "alone_rows": sum(mb.num_tokens for mb in alone),
            "shared_scores": shared_scores, "alone_scores": alone_scores,
        }), flush=True)
    shutdown_parallel(destroy_process_group=__name__ == "__main__")  # in-process (tests.helpers) keeps the group


if __name__ == "__main__":
    main()
