"""What a training step costs, counted (not timed), on a tiny random qwen2 (TP=1, CPU).

    train_cost_check.py OUT_DIR

Prints "RESULT {json}" with:
  logprobs:  max |new - reference| of log-probs, entropies and gradients, where the reference is
             today's whole-row path (dense [T, T] block-causal mask, logits at every position);
  logits:    the largest op output with the vocabulary as its last dimension (forward + backward
             of the chunked head) vs the pack's [T, V] and the chunk bound;
  doubling:  attention scores and all op-output elements of a forward over 4 vs 8 packed sequences
             of one fixed length;
  actor:     GPTModel forwards per train_on_samples call and the first step's metrics, for one
             and two optimizer steps per rollout and with use_rollout_logprobs.
"""

import json
import random
import sys
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OutputSizes(TorchDispatchMode):
    """Every op's output sizes while active (views excluded: they allocate nothing)."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.shapes: list[tuple[int, ...]] = []
        self.fresh_shapes: list[tuple[int, ...]] = []  # outputs of ops that write no input (new tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "is_view", False):
            return out
        fresh = not any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.total += t.numel()
                self.shapes.append(tuple(t.shape))
                if fresh:
                    self.fresh_shapes.append(tuple(t.shape))
        return out


def main() -> None:
    out_dir = Path(sys.argv[1])
    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.hf.checkpoint import HFCheckpoint
    from slimectl.backends.megatron.checkpoint import load_hf_into_model
    from slimectl.backends.megatron.logprobs import compute_log_probs, log_probs_from_output, output_weight
    from slimectl.backends.megatron.packing import pack_samples
    from slimectl.backends.megatron.parallel import init_parallel, shutdown_parallel
    from slimectl.backends.megatron.provider import build_gpt_model
    from slimectl.contract.samples import Sample
    from slimectl.starter_models.tiny_models import build_tiny_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_dir = build_tiny_model("qwen2", out_dir / "qwen2", seed=3, vocab_size=300, initializer_range=0.1)
    init_parallel(tp=1, pp=1)
    arch = arch_from_dir(model_dir)
    padded = arch.padded_vocab_size(1)
    model = build_gpt_model(arch, padded, init=False)
    load_hf_into_model(model, arch, HFCheckpoint(str(model_dir)), padded, 0, 1)
    rng = random.Random(0)

    def sample(prompt: int, resp: int, i: int = 0) -> Sample:
        return Sample(index=i, group_index=i // 2, tokens=[rng.randrange(3, 300) for _ in range(prompt + resp)],
                      response_length=resp, rollout_log_probs=[-5.0] * resp, reward=float(i % 3 == 0))

    samples = [sample(rng.randint(4, 20), rng.randint(5, 16), i) for i in range(8)]
    (mb,) = pack_samples(samples, 10_000)
    res: dict = {}

    # ------------------------------------------------------------ log-probs vs today's whole-row path
    def reference(with_grad: bool):
        with torch.set_grad_enabled(with_grad):
            logits = model(mb.input_ids, mb.position_ids, mb.attention_mask)  # dense mask, all positions
            return log_probs_from_output(logits, mb, arch.vocab_size, 0.8, True)

    def grads(rows) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        sum(r.log_probs.sum() + 0.1 * r.entropy.sum() for r in rows).backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    model.eval()
    chunk = 16 * padded  # 16 response rows per chunk: several chunks here
    ref_rows, ref_grads = reference(True), None
    ref_grads = grads(ref_rows)
    def new(with_grad: bool):
        with torch.set_grad_enabled(with_grad):
            try:
                return compute_log_probs(model, mb, arch.vocab_size, 0.8, True, chunk_elements=chunk)
            except TypeError:  # (a checkout without chunking: measured as it is)
                return compute_log_probs(model, mb, arch.vocab_size, 0.8, True)

    with OutputSizes() as sizes:
        new_rows = new(True)
        new_grads = grads(new_rows)
    nograd_rows = new(False)
    res["logprobs"] = {
        "lp": max(float((a.log_probs - b.log_probs).abs().max()) for a, b in zip(ref_rows, new_rows)),
        "lp_nograd": max(float((a.log_probs - b.log_probs).abs().max()) for a, b in zip(ref_rows, nograd_rows)),
        "entropy": max(float((a.entropy - b.entropy).abs().max()) for a, b in zip(ref_rows, new_rows)),
        "grad": max(float((a - b).abs().max()) for a, b in zip(ref_grads, new_grads)),
        "grad_scale": max(float(a.abs().max()) for a in ref_grads),
        "n_response": sum(s.response_length for s in samples),
    }
    vocab_outputs = [s for s in sizes.shapes if s and s[-1] == padded]
    res["logits"] = {"largest_vocab_output": max(torch.Size(s).numel() for s in vocab_outputs),
                     "T_times_V": mb.length * padded, "N_times_V": res["logprobs"]["n_response"] * padded,
                     "chunk_elements": chunk,
                     "chunks": -(-res["logprobs"]["n_response"] // (chunk // padded)),
                     # new [V, H] tensors (the LM head's weight gradient) made in the forward and backward
                     "weight_sized_new": sum(s == tuple(output_weight(model).shape) for s in sizes.fresh_shapes)}

    # ------------------------------------------------------------ gradients independent of the thread count
    long_mb = pack_samples([sample(200, 100, i) for i in range(3)], 10_000)[0]
    threads = torch.get_num_threads()
    per_threads = []
    for n_threads in (1, 2):
        torch.set_num_threads(n_threads)
        model.zero_grad(set_to_none=True)
        sum(r.log_probs.sum() + r.entropy.sum() for r in compute_log_probs(model, long_mb, arch.vocab_size, 1.0, True)
            ).backward()
        per_threads.append([p.grad.detach().clone() for p in model.parameters()])
    torch.set_num_threads(threads)
    res["threads"] = {"bit_equal": all(torch.equal(a, b) for a, b in zip(*per_threads))}

    # ------------------------------------------------------------ doubling the pack at a fixed length
    from slimectl.backends.megatron import logprobs as lp_mod

    doubling = {}
    for n in (4, 8):
        pack = pack_samples([sample(32, 32, i) for i in range(n)], 10_000)
        assert len(pack) == 1
        counter = getattr(sys.modules.get("slimectl.backends.megatron.attention"), "SCORES", None)
        if counter is not None:
            counter.reset()
        with torch.no_grad(), OutputSizes() as sizes:
            lp_mod.forward_micro_batch(model, pack[0])
        doubling[n] = {"tokens": pack[0].length, "op_output_elements": sizes.total,
                       "attention_scores": counter.scores if counter is not None else None}
    res["doubling"] = doubling

    # ------------------------------------------------------------ actor: forwards per rollout
    from slimectl.backends.megatron.actor import MegatronActor
    from slimectl.contract.config_schema import AlgorithmSection, TrainSection

    shutdown_parallel()
    actor_res = {}
    for name, train_kw in (("one_step", {}), ("two_steps", {"num_steps_per_rollout": 2}),
                           ("rollout_logprobs", {"use_rollout_logprobs": True})):
        a = MegatronActor(arch, padded, TrainSection(lr=1e-3, **train_kw), AlgorithmSection(), tp=1, pp=1)
        a.load_hf(model_dir)
        count = [0]
        a.module.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        ms = a.train_on_samples(samples)
        actor_res[name] = {"forwards": count[0], "micro_batches": [m["train/num_micro_batches"] for m in ms],
                           "metrics": ms}
        del a
    res["actor"] = actor_res

    print("RESULT " + json.dumps(res), flush=True)
    shutdown_parallel(destroy_process_group=__name__ == "__main__")


if __name__ == "__main__":
    main()
