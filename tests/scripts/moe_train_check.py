"""MegatronActor training steps on a tiny Qwen3-MoE at the expert-parallel size of this launch
(EP = world size: every rank a data-parallel rank holding num_experts / EP experts).

    [torchrun --nproc_per_node EP] moe_train_check.py HF_DIR WORK_DIR AUX_COEFF [RESUME_STATE]

Samples are made here (fixed random tokens and rewards; lengths such that under EP=2 the two
data-parallel ranks pack a different number of micro-batches). Writes under WORK_DIR (rank 0,
``ep{EP}_*``): one GRPO step from the HF weights with aux coefficient 0 (``c0``), one with
AUX_COEFF (``aux``), each its metrics and updated weights (HF names, the whole model); the actor
of ``aux`` then goes on (``resume``: its step is ``resume_first``): save_state, a second step
with coefficient 0 (weights and metrics), and a fresh actor (coefficient 0) that loads the state
and takes the second step again; the state directory is kept (``ep{EP}_state``). With RESUME_STATE (a state saved by another
launch): a fresh actor loads it, its weights are written (``loaded``) and it takes the second
step with coefficient 0 (``cross``). Prints ``RESULT {json}`` (rank 0) with the paths and the
micro-batch counts each rank packed.
"""

import json
import sys
import time
from pathlib import Path

import torch

BUDGET = 40  # tokens per micro-batch
ADAM_EPS = 1e-3
"""Adam's first update is lr * g / (|g| + eps): with the default eps 1e-8 a gradient entry near 0
moves its weight by up to lr on float rounding alone, so two layouts (EP=1 vs 2: other reduction
orders) could differ by ~lr in a few entries. An eps above such entries keeps the update
proportional to the gradient, so weight differences measure gradient differences."""


def make_samples(vocab: int):
    from slimectl.contract.samples import Sample

    g = torch.Generator().manual_seed(11)
    # (prompt, response) lengths: ranks 0 / 1 of two get samples 0,2,4 / 1,3,5 -> 2 / 1 micro-batches
    lengths = [(8, 12), (4, 6), (10, 12), (3, 5), (6, 9), (4, 6)]
    rewards = [1.0, 0.0, 0.2, 1.0, 0.7, 0.1]
    out = []
    for i, ((p, r), reward) in enumerate(zip(lengths, rewards)):
        toks = torch.randint(0, vocab, (p + r,), generator=g).tolist()
        out.append(Sample(index=i, group_index=i // 3, tokens=toks, response_length=r, reward=reward))
    return out


def main() -> None:
    hf_dir, work, coeff = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    resume_from = sys.argv[4] if len(sys.argv) > 4 else None
    t0 = time.perf_counter()
    import torch.distributed as dist

    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.megatron.actor import MegatronActor
    from slimectl.backends.megatron.packing import pack_samples
    from slimectl.backends.megatron.parallel import init_parallel
    from slimectl.contract.config_schema import AlgorithmSection, TrainSection

    import os

    ep = int(os.environ.get("WORLD_SIZE", "1"))  # one process, or the torchrun ranks
    init_parallel(ep=ep)
    rank = dist.get_rank()
    arch = arch_from_dir(hf_dir)
    padded = arch.padded_vocab_size(1)
    samples = make_samples(arch.vocab_size)
    work.mkdir(parents=True, exist_ok=True)
    tag = f"ep{ep}"
    out: dict = {"ep": ep, "micro_batches": [len(pack_samples(samples[r::ep], BUDGET)) for r in range(ep)]}

    def actor(c: float) -> MegatronActor:
        a = MegatronActor(arch, padded, TrainSection(lr=1e-2, adam_eps=ADAM_EPS, dp=ep, ep=ep, max_tokens_per_micro_batch=BUDGET,
                                                     moe_aux_loss_coeff=c),
                          AlgorithmSection(), ep=ep)
        a.load_hf(hf_dir)
        return a

    def dump(name: str, a: MegatronActor, metrics=None) -> None:
        w = a.hf_state_dict()  # collective; the whole model on rank 0
        if rank == 0:
            torch.save(w, work / f"{tag}_{name}.pt")
            out[name] = {"weights": str(work / f"{tag}_{name}.pt"), "metrics": metrics}

    a = actor(0.0)
    dump("c0", a, a.train_on_samples(samples)[0])
    del a

    state = work / f"{tag}_state"
    a = actor(coeff)  # one actor for ``aux`` and the first step of ``resume``: the same step from the HF weights
    dump("aux", a, a.train_on_samples(samples)[0])
    out["resume_first"] = out.get("aux")
    a.save_state(state)
    a.moe.coeff = 0.0  # (not saved: a resume may change it, as `--set train.moe_aux_loss_coeff` would)
    dump("resume_second", a, a.train_on_samples(samples)[0])
    del a
    b = actor(0.0)
    b.load_state(state)
    dump("resumed", b, b.train_on_samples(samples)[0])
    del b
    out["state"] = str(state)

    if resume_from:
        c = actor(0.0)
        c.load_state(resume_from)
        dump("loaded", c)
        dump("cross", c, c.train_on_samples(samples)[0])
        del c

    out["seconds"] = time.perf_counter() - t0
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    from slimectl.backends.megatron.parallel import shutdown_parallel

    shutdown_parallel(destroy_process_group=__name__ == "__main__")  # in-process (tests.helpers) keeps the group


if __name__ == "__main__":
    main()
