"""Routing replay end to end on a tiny Qwen3-MoE (fp32, one rank): the embedded engine's scheduler
rolls out samples with their routed experts, the Megatron actor recomputes their log-probs with
``train.use_rollout_routing_replay`` on and off.

    [torchrun --nproc_per_node EP] routing_replay_check.py HF_DIR [ROLLOUTS]

(EP = the world size: every rank a data-parallel rank holding num_experts / EP experts; each rank
rolls out the same samples, and the figures are the worst over the ranks.)

Samples: 6 prompts of different lengths, 10 sampled tokens each (temperature 1, seeded), stored as
the rollout stores them (``Sample.append_response_tokens`` with SGLang's base64 ``routed_experts``).
Then a second rollout of the same prompts by an engine whose routers are perturbed (routes recorded
under slightly different weights, so some differ from what the trainer's routers pick).
With ROLLOUTS (a file :func:`write_rollouts` wrote, e.g. in the test's process, which has
transformers imported already) both rollouts are read from it instead: the ranks then never load
the engine's transformers model (~7 CPU-s a rank); the samples are the same (seeded).
Prints ``RESULT {json}``: for each rollout the max |train - rollout| log-prob with replay on and off,
whether the experts the trainer's routers used equal the recorded ones (read back from every router),
and how many (token, layer) routes the trainer picks differently on its own.
"""

import base64
import json
import sys
import time

import torch

PROMPTS = 6
NEW_TOKENS = 10
PERTURB = 0.05  # relative noise on the engine's router weights for the second rollout


def rollout(hf_dir: str, perturb: float):
    from slimectl.contract.samples import Sample
    from slimectl.engines.embedded.requests import GenRequest
    from slimectl.engines.embedded.sampling_params import SamplingParams
    from slimectl.engines.embedded.scheduler import GenerationScheduler

    scheduler = GenerationScheduler(hf_dir, max_batch_size=8)
    if perturb:
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for gate in scheduler.batch.gates:
                gate.weight.add_(perturb * gate.weight.abs().mean() * torch.randn(gate.weight.shape, generator=g))
    scheduler.start()
    try:
        prompts = [torch.randint(3, scheduler.vocab_size, (3 + 4 * i,), generator=torch.Generator().manual_seed(i)).tolist()
                   for i in range(PROMPTS)]
        reqs = [GenRequest(rid=f"r{i}", input_ids=p, return_logprob=True, return_routed_experts=True,
                           params=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, sampling_seed=i, ignore_eos=True))
                for i, p in enumerate(prompts)]
        results = [f.result(120) for f in [scheduler.submit(r) for r in reqs]]
    finally:
        scheduler.stop()
    samples = []
    for i, (p, res) in enumerate(zip(prompts, results)):
        s = Sample(index=i, group_index=i, tokens=list(p), reward=float(i % 2))
        meta = {"routed_experts": base64.b64encode(res.routed_experts.numpy().tobytes()).decode(),
                "weight_version": res.weight_version, "finish_reason": res.finish_reason}
        s.append_response_tokens(res.output_ids, res.output_token_logprobs, True, meta)
        samples.append(s)
    return samples


ROLLOUTS = (("same_weights", 0.0), ("perturbed_router", PERTURB))


def write_rollouts(hf_dir: str, path) -> None:
    """Both rollouts of HF_DIR (``{name: [Sample]}``), pickled to PATH for :func:`main`'s ROLLOUTS."""
    import pickle
    from pathlib import Path

    data = pickle.dumps({name: rollout(hf_dir, perturb) for name, perturb in ROLLOUTS})
    tmp = Path(f"{path}.tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def main() -> None:
    hf_dir = sys.argv[1]
    recorded = None
    if len(sys.argv) > 2:
        import pickle
        from pathlib import Path

        recorded = pickle.loads(Path(sys.argv[2]).read_bytes())
    t0 = time.perf_counter()
    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.megatron.actor import MegatronActor
    from slimectl.backends.megatron.parallel import init_parallel
    from slimectl.backends.megatron.routing_replay import sample_routes
    from slimectl.contract.config_schema import AlgorithmSection, TrainSection

    import os

    import torch.distributed as dist

    ep = int(os.environ.get("WORLD_SIZE", "1"))  # one process, or the torchrun ranks
    init_parallel(ep=ep)
    arch = arch_from_dir(hf_dir)
    # with a reference model (use_kl_loss): its routers replay too
    actor = MegatronActor(arch, arch.padded_vocab_size(1),
                          TrainSection(use_rollout_routing_replay=True, dp=ep, ep=ep),
                          AlgorithmSection(use_kl_loss=True, kl_loss_coef=0.01), ep=ep)
    actor.load_hf(hf_dir)
    replay = actor.replay
    routers = replay.routers[id(actor.module)]
    out: dict = {"moe_layers": len(routers), "topk": arch.moe_topk, "ep": ep}

    def logprob_gap(samples) -> float:
        lps = actor.compute_log_probs(samples, temperature=1.0)
        return max(float((lp - torch.tensor(s.rollout_log_probs)).abs().max()) for lp, s in zip(lps, samples))

    def used_routes():  # [row tokens, layers, topk] as the routers used them in the last forward
        return torch.stack([r.router_replay.recorded_topk_idx for r in routers], 1)

    for name, perturb in ROLLOUTS:
        samples = recorded[name] if recorded is not None else rollout(hf_dir, perturb)
        res: dict = {}
        # one micro-batch holds every sample: the routers' last forward covers them all
        assert actor.train_cfg.max_tokens_per_micro_batch >= sum(len(s.tokens) for s in samples)
        res["gap_replay_on"] = logprob_gap(samples)
        used, valid = used_routes(), routers[0].router_replay.valid
        target = torch.stack([r.router_replay.target_topk_idx for r in routers], 1)
        res["forced_equal_recorded"] = bool(torch.equal(used[valid], target[valid]))
        # the recorded rows of each sample, where prepare() put them (offsets in sample order)
        offs, rows_ok = 0, True
        for s in samples:
            rec = sample_routes(s, len(routers), arch.moe_topk)
            rows_ok &= bool(torch.equal(used[offs:offs + len(s.tokens) - 1], rec))
            offs += len(s.tokens)
        res["forced_rows_equal_samples"] = rows_ok
        res["replayed_positions"] = int(valid.sum())
        actor.replay = None
        replay.clear()
        try:
            res["gap_replay_off"] = logprob_gap(samples)
            own = used_routes()
        finally:
            actor.replay = replay
        res["own_routes_differ"] = int((own[valid].sort(-1).values != target[valid].sort(-1).values).any(-1).sum())
        if not perturb:
            first = samples
        out[name] = res
    # a training step on the first rollout (its forward gives step 0's old log-probs) and the
    # reference's forward: every router of both models used the recorded routes
    m = actor.train_on_samples(first, rollout_temperature=1.0)[0]
    res = out["same_weights"]
    res["train_step_rollout_abs_diff_mean"] = m["train/train_rollout_logprob_abs_diff"]
    ok = True
    for model in (actor.module, actor.ref_model):
        for r in replay.routers[id(model)]:
            rp = r.router_replay
            ok &= bool(torch.equal(rp.recorded_topk_idx[rp.valid], rp.target_topk_idx[rp.valid]))
    res["train_and_ref_forced_equal_recorded"] = ok
    res["ref_routers"] = len(replay.routers[id(actor.ref_model)])
    # a sample rolled out without routes: one clear line naming it
    bare = first[0].__class__(index=7, tokens=first[0].tokens, response_length=first[0].response_length)
    try:
        actor.compute_log_probs([bare])
        out["missing_error"] = None
    except ValueError as exc:
        out["missing_error"] = str(exc)
    out["seconds"] = time.perf_counter() - t0
    if ep > 1:  # the worst rank's figures
        every = [None] * ep
        dist.all_gather_object(every, out)
        for name in ("same_weights", "perturbed_router"):
            for k, v in out[name].items():
                vals = [o[name][k] for o in every]
                out[name][k] = all(vals) if isinstance(v, bool) else (min(vals) if "own_routes" in k else max(vals))
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    from slimectl.backends.megatron.parallel import shutdown_parallel

    shutdown_parallel(destroy_process_group=__name__ == "__main__")


if __name__ == "__main__":
    main()
