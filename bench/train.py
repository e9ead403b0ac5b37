"""bench/train.py — the actor's training step vs a bare Megatron forward/backward/step loop.

A fixed rollout (64 samples in 16 groups of 4, 48 new tokens each, from the embedded engine's
scheduler) is trained on twice in this process, ``--runs`` times each:

- actor: ``MegatronActor.train_on_samples`` — everything a GRPO step does (old log-prob pass,
  advantages, packing, PPO loss, gradient accumulation, optimizer step, metrics);
- floor: the same packed micro-batches through a bare loop — one forward, a log-prob loss,
  backward, ``finish_grad_sync`` and ``optimizer.step`` — on the same model and optimizer.

Prints tokens/s of both, the time ratio actor/floor (target <= 1.15) — with old log-probs
recomputed (one more forward than the floor, as slime does by default) and with
``train.use_rollout_logprobs`` (the same passes as the floor) — and the padding fraction of the
packed batches (target <= 5%).

``--family qwen3-moe`` runs the same on a tiny Qwen3-MoE (8 experts, top-2; the actor adds the
MoE metrics and, with ``--aux-loss-coeff``, the load-balancing loss; the floor is the same bare loop).

    python bench/train.py [--runs 3] [--micro-batch 1024] [--family qwen2|qwen3-moe] [--aux-loss-coeff 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def make_samples(model_dir: Path, n_groups: int = 16, n: int = 4, new_tokens: int = 48):
    import random

    from slimectl.engines.embedded.requests import GenRequest
    from slimectl.engines.embedded.sampling_params import SamplingParams
    from slimectl.engines.embedded.scheduler import GenerationScheduler
    from slimectl.contract.samples import Sample, Status

    scheduler = GenerationScheduler(str(model_dir))
    scheduler.start()
    rng = random.Random(0)
    samples, futs = [], []
    try:
        for g in range(n_groups):
            prompt = [rng.randrange(3, 400) for _ in range(rng.randint(8, 24))]
            for j in range(n):
                idx = g * n + j
                futs.append((g, idx, prompt, scheduler.submit(GenRequest(f"b{idx}", prompt, SamplingParams(
                    max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, sampling_seed=idx), return_logprob=True))))
        for g, idx, prompt, fut in futs:
            res = fut.result(timeout=300)
            s = Sample(group_index=g, index=idx, tokens=list(prompt))
            s.append_response_tokens(res.output_ids, res.output_token_logprobs, True, {"weight_version": "0"})
            s.status = Status.COMPLETED
            s.reward = float(rng.random() < 0.5)
            samples.append(s)
    finally:
        scheduler.stop()
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=1024, help="train.max_tokens_per_micro_batch")
    ap.add_argument("--family", default="qwen2", choices=["qwen2", "qwen3-moe"])
    ap.add_argument("--aux-loss-coeff", type=float, default=0.0, help="train.moe_aux_loss_coeff (qwen3-moe)")
    args = ap.parse_args()
    import torch

    from slimectl.contract.config_schema import SlimectlConfig
    from slimectl.starter_models.tiny_models import build_tiny_model
    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.megatron import cpu_compat
    from slimectl.backends.megatron.actor import MegatronActor
    from slimectl.backends.megatron.logprobs import compute_log_probs
    from slimectl.backends.megatron.packing import pack_samples

    work = Path(tempfile.mkdtemp(prefix="slimectl-bench-train-"))
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128) if args.family == "qwen3-moe" else {}
    model_dir = build_tiny_model(args.family, work / "m", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                                 intermediate_size=512, initializer_range=0.1, **moe)
    samples = make_samples(model_dir)
    tokens = sum(len(s.tokens) for s in samples)
    cfg = SlimectlConfig()
    cfg.train.lr = 1e-5
    cfg.train.max_tokens_per_micro_batch = args.micro_batch
    cfg.train.moe_aux_loss_coeff = args.aux_loss_coeff
    arch = arch_from_dir(model_dir)
    actor = MegatronActor(arch, arch.padded_vocab_size(1), cfg.train, cfg.algorithm)
    actor.load_hf(model_dir)
    mbs = pack_samples(samples, cfg.train.max_tokens_per_micro_batch)
    padding = sum(mb.padding_fraction * mb.input_ids.shape[1] for mb in mbs) / sum(mb.input_ids.shape[1] for mb in mbs)

    def floor_step() -> None:
        actor.model.ddp.zero_grad_buffer()
        actor.model.optimizer.zero_grad()
        for mb in mbs:
            with cpu_compat.suspended():  # as the actor runs its passes (a no-op on GPUs)
                out = compute_log_probs(actor.model.ddp, mb, arch.vocab_size, 1.0)
                loss = -torch.cat([o.log_probs for o in out]).mean() / len(mbs)
                loss.backward()
        actor.model.ddp.finish_grad_sync()
        actor.model.optimizer.step()

    actor.train_on_samples(samples)  # warm-up of both paths
    floor_step()
    a, r, f = [], [], []
    for i in range(args.runs):
        actor.train_cfg.use_rollout_logprobs = False
        t0 = time.perf_counter()
        actor.train_on_samples(samples)
        a.append(time.perf_counter() - t0)
        actor.train_cfg.use_rollout_logprobs = True  # old log-probs from the rollout: no extra forward
        t0 = time.perf_counter()
        actor.train_on_samples(samples)
        r.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        floor_step()
        f.append(time.perf_counter() - t0)
        print(f"run {i + 1}: actor {a[-1]:.3f} s, actor with rollout log-probs {r[-1]:.3f} s, floor {f[-1]:.3f} s",
              file=sys.stderr)
    m = statistics.median
    print(json.dumps({
        "workload": f"{len(samples)} samples, {tokens} tokens, {len(mbs)} micro-batches, {args.family} h256 L4 fp32"
                    + (f", 8 experts top-2, aux loss coeff {args.aux_loss_coeff}" if moe else ""),
        "runs": args.runs,
        "actor_tok_s": round(tokens / m(a)), "floor_tok_s": round(tokens / m(f)),
        "time_ratio": round(m(a) / m(f), 3),
        "time_ratio_with_rollout_logprobs": round(m(r) / m(f), 3),
        "padding_fraction": round(padding, 4),
        "targets": {"time_ratio": 1.15, "padding_fraction": 0.05},
    }, indent=2))


if __name__ == "__main__":
    main()
