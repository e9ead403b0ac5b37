"""The Megatron actor's memory at a step (issue #16 item 5), in-process on a tiny random qwen2:

- ``train.recompute: full`` (megatron-core's activation recompute) gives the gradients of no
  recompute, and its recomputed forward attends per packed sequence as the first forward did;
- a checkpoint save writes the fused ``fc1`` halves (views, for the weight and both Adam moments)
  cloning one at a time, not all of them up front (megatron's ``_clone_if_needed``), and the saved
  state loads back bit for bit.
"""

from __future__ import annotations

import random
import threading
import weakref

import pytest
import torch

from slimectl.contract.samples import Sample
from tests.helpers import in_process_stage

VOCAB = 512
LENGTHS = [20, 31, 20, 12, 31]  # packed together: equal lengths batched, different ones alone


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model

    return build_tiny_model("qwen2", tmp_path_factory.mktemp("recompute") / "m", hidden_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=VOCAB,
                            max_position_embeddings=256, seed=0)


def _samples() -> list[Sample]:
    rng = random.Random(0)
    return [Sample(index=i, group_index=i // 2, rollout_id=0, response_length=n // 2,
                   tokens=[rng.randrange(3, VOCAB) for _ in range(n)], rollout_log_probs=[-1.0] * (n // 2),
                   reward=float(i % 2)) for i, n in enumerate(LENGTHS)]


def _actor(model, **train):
    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.megatron.actor import MegatronActor
    from slimectl.contract.config_schema import AlgorithmSection, TrainSection

    arch = arch_from_dir(model)
    a = MegatronActor(arch, arch.padded_vocab_size(1), TrainSection(**train), AlgorithmSection())
    a.load_hf(model)
    return a


def test_full_recompute_gives_the_same_gradients_attending_per_sequence(model):
    from slimectl.backends.megatron.attention import SCORES

    got = {}
    with in_process_stage():
        for mode in ("none", "full"):
            a = _actor(model, recompute=mode)
            a.compute_log_probs(_samples())  # an inference-mode forward first (its cached rotary table)
            SCORES.reset()
            m = a.train_on_samples(_samples())
            got[mode] = ({n: p.main_grad.clone() for n, p in a.module.named_parameters()}, SCORES.scores,
                         SCORES.calls, m[-1]["train/loss"] if isinstance(m, list) else m["train/loss"],
                         a.compute_log_probs(_samples()))  # a no-grad forward: no recompute there
    (g0, s0, c0, l0, lp0), (g1, s1, c1, l1, lp1) = got["none"], got["full"]
    assert all(torch.equal(x, y) for x, y in zip(lp0, lp1))
    # the backward ran every layer's forward again (2 layers, one micro-batch) ...
    assert (c0, c1) == (2, 4)
    # ... per packed sequence, as the first forward: sum(n^2) scores per head, not the pack's T^2
    heads = 4
    assert s0 == 2 * heads * sum(n * n for n in LENGTHS) and s1 == 2 * s0
    assert l0 == l1
    assert max((g0[k] - g1[k]).abs().max().item() for k in g0) <= 1e-6
    assert max(g.abs().max().item() for g in g0.values()) > 1e-3  # (gradients that say something)


def test_recompute_num_layers_must_divide_the_layers(model):
    from slimectl.contract.errors import ConfigError

    with in_process_stage(), pytest.raises(ConfigError, match=r"train.recompute_num_layers \(3\) must divide the 2 transformer layers"):
        _actor(model, recompute="full", recompute_num_layers=3)


class _LiveClones:
    """Bytes of tensors made by ``Tensor.clone`` still alive, and the most alive at once."""

    def __init__(self):
        self.live = self.peak = 0
        self.lock = threading.Lock()

    def _freed(self, n: int) -> None:
        with self.lock:
            self.live -= n

    def __enter__(self):
        self.clone = torch.Tensor.clone
        count = self

        def clone(t, *a, **k):
            out = count.clone(t, *a, **k)
            n = out.numel() * out.element_size()
            if n:
                with count.lock:
                    count.live += n
                    count.peak = max(count.peak, count.live)
                weakref.finalize(out, count._freed, n)
            return out

        torch.Tensor.clone = clone
        return self

    def __exit__(self, *exc):
        torch.Tensor.clone = self.clone


def test_a_checkpoint_save_clones_one_fused_half_at_a_time(model, tmp_path):
    with in_process_stage():
        a = _actor(model, lr=1e-3)
        a.train_on_samples(_samples())  # Adam moments that are not zeros
        fc1 = [p for n, p in a.module.named_parameters() if n.endswith("linear_fc1.weight")]
        half = fc1[0].numel() * fc1[0].element_size() // 2
        with _LiveClones() as clones:
            a.save_state(tmp_path / "state")
        files = len(list((tmp_path / "state").glob("*.distcp")))  # written in parallel, a thread each
        # before: every gate/up half of every fc1 weight and of both its Adam moments cloned up front
        # (2 layers x 3 tensors x 2 halves = 12 halves, 384 KiB here) and held through the writes;
        # now one half at a time per file being written
        assert files in range(1, 5), files
        assert clones.peak <= files * half, (clones.peak, files, half)
        b = _actor(model, lr=1e-3)
        b.load_state(tmp_path / "state")
    for (n, p), q in zip(a.module.named_parameters(), b.module.parameters()):
        assert torch.equal(p, q), n
    sa, sb = a.model.optimizer.state_dict()["state"], b.model.optimizer.state_dict()["state"]
    for k, st in sa.items():
        if isinstance(st, dict):
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(st[name], sb[k][name]), (k, name)
