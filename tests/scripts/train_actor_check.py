"""MegatronActor checks on rollout samples (TP and PP from argv, default 1; DP = world / (TP*PP)).

    [torchrun --nproc_per_node TP*PP*DP] train_actor_check.py HF_DIR SAMPLES_JSON [TP [PP [PARTS]]]

SAMPLES_JSON: [{"tokens", "response_length", "rollout_log_probs", "reward", "group_index"}, ...].
Prints "RESULT {json}" with:
  grpo:   metrics of a GRPO step (use_kl_loss low_var_kl, TIS) on fresh rollouts, then of a second
          call on the same samples; mean new-old log-prob of positive / negative advantage samples
  sft:    loss of 5 sft_loss steps on one fixed batch
  accum:  one GRPO step with 1 vs 2 packed micro-batches: max |weight diff|, metrics of both
  multi:  2 calls x 2 steps (per-token loss, entropy bonus, warm-up + cosine LR); "resumed": the
          second call again, on a fresh actor that loaded the state saved after the first
PARTS: the comma-separated parts to run (default grpo,sft,accum,multi,resume; "resume" is the
multi part's save and resumed call): a two-rank run computes only what its test compares.
"""

import json
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    hf_dir, samples_json = sys.argv[1], sys.argv[2]
    tp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    pp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    parts = set((sys.argv[5] if len(sys.argv) > 5 else "grpo,sft,accum,multi,resume").split(","))
    t0 = time.perf_counter()
    from slimectl.contract.config_schema import AlgorithmSection, TrainSection
    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.contract.samples import Sample
    from slimectl.algorithms.rewards import normalize_rewards_by_group
    from slimectl.backends.megatron.actor import MegatronActor
    from slimectl.backends.megatron.packing import pack_samples

    arch = arch_from_dir(hf_dir)
    padded = arch.padded_vocab_size(tp)
    samples = [Sample(**d) for d in json.loads(Path(samples_json).read_text())]
    out: dict = {}

    def actor(train_kw, algo_kw):
        a = MegatronActor(arch, padded, TrainSection(**train_kw), AlgorithmSection(**algo_kw), tp=tp, pp=pp)
        a.load_hf(hf_dir)
        return a

    t_import = time.perf_counter() - t0

    # ---------------------------------------------------------------- GRPO + KL + TIS
    if "grpo" in parts:
        t = time.perf_counter()
        a = actor({"lr": 1e-3}, {"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl",
                                 "use_tis": True})
        before = a.compute_log_probs(samples)
        ref_before = a.compute_log_probs(samples, ref=True)
        m0 = a.train_on_samples(samples, rollout_temperature=1.0)
        after = a.compute_log_probs(samples)
        ref_after = a.compute_log_probs(samples, ref=True)
        m1 = a.train_on_samples(samples, rollout_temperature=1.0)
        adv = normalize_rewards_by_group([s.reward_value(None) for s in samples], [s.group_index for s in samples])
        delta = torch.stack([(x - y).mean() for x, y in zip(after, before)])
        out["grpo"] = {
            "step0": m0, "step1": m1, "advantages": adv.tolist(), "delta": delta.tolist(),
            "pos_delta": float(delta[adv > 0].mean()), "neg_delta": float(delta[adv < 0].mean()),
            "ref_moved": max(float((x - y).abs().max()) for x, y in zip(ref_after, ref_before)),
            "ref_eq_actor_before": max(float((x - y).abs().max()) for x, y in zip(ref_before, before)),
            "hf_keys": sorted(a.hf_state_dict())[:3], "hf_count": len(a.hf_state_dict()),
            "seconds": time.perf_counter() - t,
        }
        del a

    # ---------------------------------------------------------------- SFT on a fixed batch
    if "sft" in parts:
        t = time.perf_counter()
        a = actor({"lr": 1e-3}, {"loss_type": "sft_loss"})
        sft = [a.train_on_samples(samples)[0] for _ in range(5)]
        out["sft"] = {"loss": [m["train/loss"] for m in sft], "grad_norm": [m["train/grad_norm"] for m in sft],
                      "seconds": time.perf_counter() - t}
        del a

    # ---------------------------------------------------------------- gradient accumulation
    if "accum" in parts:
        t = time.perf_counter()
        total = sum(len(s.tokens) for s in samples)
        budget = next(b for b in range(total // 2, total + 1) if len(pack_samples(samples, b)) == 2)
        res = {}
        for name, b in (("one", total), ("two", budget)):
            a = actor({"lr": 1e-3, "max_tokens_per_micro_batch": b}, {})
            w0 = a.hf_state_dict()
            m = a.train_on_samples(samples)[0]
            res[name] = (m, a.hf_state_dict())
            del a
        w1, w2 = res["one"][1], res["two"][1]
        out["accum"] = {
            "budget": budget, "one": res["one"][0], "two": res["two"][0],
            # (under PP only rank 0 gets the whole model back; it is the rank that prints)
            "max_weight_diff": max((float((w1[k] - w2[k]).abs().max()) for k in w1), default=None),
            "max_weight_move": max((float((w1[k] - w0[k]).abs().max()) for k in w1), default=None),
            "seconds": time.perf_counter() - t,
        }
    # ---------------------------------------------------------------- 2 steps, per-token loss, warmup
    # (and resume: a fresh actor loading the state saved after the first call continues exactly)
    import torch.distributed as dist

    if "multi" in parts:
        t = time.perf_counter()

        def multi_actor():
            m = MegatronActor(arch, padded, TrainSection(lr=1e-3, min_lr=1e-4, lr_warmup_steps=1,
                                                         lr_decay_style="cosine", num_steps_per_rollout=2),
                              AlgorithmSection(calculate_per_token_loss=True, entropy_coef=0.01), tp=tp, pp=pp,
                              total_steps=3)
            m.load_hf(hf_dir)
            return m

        state = Path(samples_json).parent / f"multi_state_tp{tp}_pp{pp}_world{dist.get_world_size()}"
        a = multi_actor()
        ms = a.train_on_samples(samples)
        if "resume" in parts:
            a.save_state(state)
        ms += a.train_on_samples(samples)
        del a
        out["multi"] = {"metrics": ms}
        if "resume" in parts:
            b = multi_actor()
            b.load_state(state)
            out["multi"]["resumed"] = b.train_on_samples(samples)
            del b
        out["multi"]["seconds"] = time.perf_counter() - t

    out["import_s"] = t_import
    out["total_s"] = time.perf_counter() - t0

    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    from slimectl.backends.megatron.parallel import shutdown_parallel

    shutdown_parallel(destroy_process_group=__name__ == "__main__")  # in-process (tests.helpers) keeps the group


if __name__ == "__main__":
    main()
