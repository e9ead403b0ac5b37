"""Checkpointed RNG states: after load_state every generator continues exactly where it was saved.

    actor_rng_check.py HF_DIR OUT_DIR
Prints "RESULT {json}" with the draws after saving and after loading into a fresh actor.
"""

import json
import random
import sys

import torch


def draws() -> list[float]:
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():  # the model-parallel generator (TP dropout)
        tp = torch.rand(2).tolist()
    return [random.random(), *torch.rand(2).tolist(), *tp]


def main() -> None:
    hf_dir, out = sys.argv[1], sys.argv[2]
    from slimectl.contract.config_schema import AlgorithmSection, TrainSection
    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.megatron.actor import MegatronActor

    arch = arch_from_dir(hf_dir)
    a = MegatronActor(arch, arch.padded_vocab_size(1), TrainSection(), AlgorithmSection())
    a.load_hf(hf_dir)
    a.model.ddp.zero_grad_buffer()
    a.model.optimizer.step()  # an optimizer with state, as after any trained rollout
    random.seed(11)
    torch.manual_seed(11)
    draws()  # move every generator away from its seed
    a.save_state(out)
    saved = draws()
    random.seed(99)
    torch.manual_seed(99)
    draws()
    a.load_state(out)
    print("RESULT " + json.dumps({"saved": saved, "loaded": draws()}), flush=True)


if __name__ == "__main__":
    main()
