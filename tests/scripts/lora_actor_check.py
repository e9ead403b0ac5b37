"""MegatronActor with LoRA (train.lora) on fixed samples (TP, PP from argv; DP = world / (TP*PP)).

    [torchrun --nproc_per_node N] lora_actor_check.py HF_DIR SAMPLES_JSON OUT_DIR [TP [PP [TARGETS]]]

Prints "RESULT {json}" (rank 0) with:
  step0_vs_base: max |log-prob| difference of the LoRA actor before training and a full-weight actor
  ref_vs_base:   the same for the LoRA actor's reference (adapters off), after two steps
  metrics:       the two GRPO steps' metrics (use_kl_loss, low_var_kl)
  moved:         max |log-prob change| after the steps; base_moved: max |change| of any base weight
  trainable:     adapter elements this rank's optimizer holds; base_params: the model's elements
  after:         the log-probs after the steps (for TP/PP comparisons)
  resumed:       the third step's metrics on an actor loaded from the state saved after two, and the
                 straight run's third step ("straight"); resumed_lp_diff: their log-probs' max difference
Writes OUT_DIR/adapter (the PEFT adapter after two steps, from iter_adapter_tensors) and
OUT_DIR/after.json (the log-probs after two steps), on rank 0.
"""

import json
import sys
from pathlib import Path

import torch


def max_diff(xs, ys) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(xs, ys))


def main() -> None:
    hf_dir, samples_json, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    tp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    pp = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    targets = sys.argv[6] if len(sys.argv) > 6 else "all-linear"
    import torch.distributed as dist

    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.hf.peft_adapter import adapter_config, write_adapter
    from slimectl.backends.megatron.actor import MegatronActor
    from slimectl.contract.config_schema import AlgorithmSection, LoraSection, TrainSection
    from slimectl.contract.samples import Sample

    arch = arch_from_dir(hf_dir)
    padded = arch.padded_vocab_size(tp)
    samples = [Sample(**d) for d in json.loads(Path(samples_json).read_text())]
    lora = LoraSection(rank=4, alpha=8, target_modules=targets if targets == "all-linear" else targets.split(","))
    algo = {"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl"}
    out: dict = {}

    def actor(with_lora: bool):
        train = TrainSection(lr=1e-2, lora=lora if with_lora else None, seed=7)
        a = MegatronActor(arch, padded, train, AlgorithmSection(**algo), tp=tp, pp=pp, total_steps=10)
        a.load_hf(hf_dir)
        return a

    base = actor(False)
    base_lp = base.compute_log_probs(samples)
    del base
    a = actor(True)
    out["step0_vs_base"] = max_diff(a.compute_log_probs(samples), base_lp)
    base_w = {k: v.clone() for k, v in a.hf_state_dict().items()}
    out["trainable"] = sum(p.numel() for g in a.model.optimizer.param_groups for p in g["params"])
    out["base_params"] = sum(p.numel() for p in a.module.parameters() if not p.requires_grad)
    out["adapter_params"] = a.lora.num_parameters()
    out["metrics"] = a.train_on_samples(samples) + a.train_on_samples(samples)
    after = a.compute_log_probs(samples)
    out["moved"] = max_diff(after, base_lp)
    out["ref_vs_base"] = max_diff(a.compute_log_probs(samples, ref=True), base_lp)
    out["base_moved"] = max((float((v - base_w[k]).abs().max()) for k, v in a.hf_state_dict().items()), default=0.0)
    out["after"] = [x.tolist() for x in after]
    tensors = list(a.iter_adapter_tensors())  # collective: every rank iterates
    if dist.get_rank() == 0:
        write_adapter(tensors, out_dir / "adapter", adapter_config(lora, hf_dir))
        out["adapter_names"] = len(tensors)
    state = out_dir / f"state_tp{tp}_pp{pp}"
    a.save_state(state)
    out["straight"] = a.train_on_samples(samples)
    straight_lp = a.compute_log_probs(samples)
    del a
    b = actor(True)
    b.load_state(state)
    out["resumed"] = b.train_on_samples(samples)
    out["resumed_lp_diff"] = max_diff(b.compute_log_probs(samples), straight_lp)
    del b
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    from slimectl.backends.megatron.parallel import shutdown_parallel

    shutdown_parallel(destroy_process_group=__name__ == "__main__")


if __name__ == "__main__":
    main()
