"""MegatronCritic checks at a TP/PP layout (DP = world / (TP*PP)): values, two training calls, weights.

    [torchrun --nproc_per_node TP*PP*DP] critic_check.py HF_DIR OUT_PT [TP [PP [SAVE_DIR|- [LOAD_DIR]]]]

Eight made-up samples (fixed token ids, response lengths 1..6, some loss-masked tokens). The value head
is set by hand (non-zero, so the trunk learns too), then:
  values0:  V_old of every response token (every rank gets all of them)
  step:     one critic step on all 8 samples towards fixed returns (value loss, clipfrac, grad norm)
  values1:  the values after it
  steps2:   a second call with two global batches of 4 (two more steps)
  values2:  the values after them
SAVE_DIR: the critic's torch_dist checkpoint (MegatronCritic.save_to) is written there after the first step.
LOAD_DIR: the first step is not taken: the critic resumes from that checkpoint instead (any layout), so
values1, steps2, values2 and the weights continue from there.
Rank 0 prints "RESULT {json}" (values as lists, metrics) and saves the whole critic gathered to one rank
(HF-named trunk tensors, TP shards gathered, pipeline stages sent to rank 0, plus the value head) to OUT_PT.
"""

import json
import sys
import time


def make_samples():
    from slimectl.contract.samples import Sample

    out = []
    for i in range(8):
        prompt = [5 + i, 17, 3 + 2 * i, 40]
        resp = [(11 * i + 7 * k) % 250 + 10 for k in range(1 + i % 6)]
        s = Sample(group_index=i // 2, index=i, tokens=prompt + resp, response_length=len(resp))
        s.loss_mask = [0 if (k == 1 and i % 3 == 0) else 1 for k in range(len(resp))]
        out.append(s)
    return out


def main() -> None:
    import torch
    import torch.distributed as dist

    hf_dir, out_pt = sys.argv[1], sys.argv[2]
    tp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    pp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    save_dir = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] != "-" else None
    load_dir = sys.argv[6] if len(sys.argv) > 6 else None
    t0 = time.perf_counter()
    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.megatron.checkpoint import model_to_hf_tensors, pipeline_stages_to_rank0
    from slimectl.backends.megatron.critic_trainer import MegatronCritic
    from slimectl.backends.megatron.parallel import init_parallel, shutdown_parallel
    from slimectl.contract.config_schema import AlgorithmSection, CriticSection, TrainSection

    info = init_parallel(tp=tp, pp=pp, seed=11)
    arch = arch_from_dir(hf_dir)
    padded = arch.padded_vocab_size(tp)
    samples = make_samples()
    algo = AlgorithmSection(advantage_estimator="ppo")
    critic = MegatronCritic(arch, padded, TrainSection(lr=1e-3, max_tokens_per_micro_batch=24),
                            CriticSection(lr=1e-4, value_clip=0.05), algo, tp=tp, pp=pp, total_steps=10)
    critic.load_hf(hf_dir)
    head = critic.module.value_head
    if head is not None:  # the last stage: a head set by hand, the same on every rank
        with torch.no_grad():
            head.weight.copy_(0.2 * torch.linspace(-1.0, 1.0, arch.hidden_size).unsqueeze(0))
            head.bias.fill_(0.1)
        critic.model.optimizer.reload_model_params()

    masks = [torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples]
    v0 = critic.values(samples)
    returns = [v + torch.linspace(-0.3, 0.4, v.numel()) * (1 if i % 2 else -1) for i, v in enumerate(v0)]
    if load_dir is None:
        step = critic.train_on_returns(samples, [list(range(8))], masks, v0, returns)
    else:
        step = []
        critic.load_from(load_dir)
    if save_dir is not None:
        critic.save_to(save_dir)
    v1 = critic.values(samples)
    steps2 = critic.train_on_returns(samples, [[0, 1, 2, 3], [4, 5, 6, 7]], masks, v1, returns)
    v2 = critic.values(samples)

    # the whole critic on rank 0
    tp_group = None
    if tp > 1:
        from megatron.core import parallel_state as ps

        tp_group = ps.get_tensor_model_parallel_group()
    own = model_to_hf_tensors(critic.module.gpt, arch, tp_group)
    if pp > 1:
        own = pipeline_stages_to_rank0(own, critic.model.pp_group, send=info.tp_rank == 0 and info.dp_rank == 0,
                                       device=torch.device("cpu"))
    weights = {k: v.detach().clone() for k, v in own}
    heads: list = [None] * info.world_size
    mine = {k: v.detach().clone() for k, v in head.state_dict().items()} if head is not None else None
    dist.all_gather_object(heads, mine)
    weights.update({f"value_head.{k}": v for k, v in next(h for h in heads if h is not None).items()})

    if info.rank == 0:
        torch.save(weights, out_pt)

        def rows(vs):
            return [v.tolist() for v in vs]

        print("RESULT " + json.dumps({
            "layout": [pp, tp, critic.model.dp], "values0": rows(v0), "values1": rows(v1), "values2": rows(v2),
            "step": step, "steps2": steps2, "n_weights": len(weights), "total_s": time.perf_counter() - t0}))
    shutdown_parallel(destroy_process_group=__name__ == "__main__")  # in-process (tests.helpers) keeps the group


if __name__ == "__main__":
    main()
