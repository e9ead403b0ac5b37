"""slimectl.backends.megatron.critic: the value model on megatron-core, one rank, CPU/gloo.

In this process (tests.helpers.in_process_stage: Megatron's CPU shim and one-rank groups kept for
the session). A tiny Llama is written with transformers (no tokenizer needed: token ids are made
up), loaded into the actor's GPTModel and into the value model's trunk.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import in_process_stage

H = 32


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("critic") / "llama"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=200, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, initializer_range=0.2)
    LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    return d


class _S:
    """The fields pack_samples reads of a Sample."""

    def __init__(self, tokens, response_length):
        self.tokens, self.response_length = tokens, response_length


SAMPLES = [_S([5, 6, 7, 8, 9, 10], 3), _S([11, 12, 13], 1), _S([20, 21, 22, 23, 24, 25, 26], 5)]


def response_values(model, micro_batch):
    """Per packed sequence: the values of its response tokens (differentiable)."""
    from slimectl.backends.megatron.critic import forward_values, response_rows

    return response_rows(forward_values(model, micro_batch), micro_batch)


def padded_values(per_sample: dict[int, torch.Tensor], n: int) -> torch.Tensor:
    """``{sample index: values}`` of ``n`` samples -> ``[n, T]`` right-padded with zeros (the layout of
    :func:`slimectl.algorithms.gae.compute_gae`)."""
    missing = [i for i in range(n) if i not in per_sample]
    if missing:
        raise ValueError(f"no values for samples {missing[:5]}")
    T = max((int(per_sample[i].numel()) for i in range(n)), default=0)
    first = per_sample[0] if n else torch.zeros(0)
    out = first.new_zeros(n, T)
    for i in range(n):
        v = per_sample[i].reshape(-1)
        out[i, : v.numel()] = v
    return out


def test_value_model_forward_and_one_step_lowers_the_value_loss(tiny_llama):
    from slimectl.algorithms.value_loss import clipped_value_loss
    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.hf.checkpoint import HFCheckpoint
    from slimectl.backends.megatron.checkpoint import load_hf_into_model
    from slimectl.backends.megatron.critic import (
        build_value_model,
        load_trunk_from_hf,
    )
    from slimectl.backends.megatron.logprobs import forward_micro_batch, response_positions
    from slimectl.backends.megatron.packing import pack_samples
    from slimectl.backends.megatron.parallel import init_parallel
    from slimectl.backends.megatron.provider import build_gpt_model

    with in_process_stage():
        init_parallel(tp=1, pp=1, seed=7)
        arch = arch_from_dir(tiny_llama)
        padded = arch.padded_vocab_size(1)
        actor = build_gpt_model(arch, padded, init=False)
        load_hf_into_model(actor, arch, HFCheckpoint(str(tiny_llama)), padded, 0, 1)
        critic = build_value_model(arch, padded, init=True)
        n_filled = load_trunk_from_hf(critic, arch, tiny_llama, padded)
        assert critic.gpt.output_layer is None and n_filled == len(list(critic.gpt.parameters()))
        assert not any(p.numel() == padded * H for n, p in critic.named_parameters() if "embedding" not in n)

        (mb,) = pack_samples(SAMPLES, 64)  # one packed row of three sequences
        with torch.no_grad():
            # the trunk is the actor's: same final hidden states, bit for bit
            actor_h = forward_micro_batch(actor, mb, hidden=True)[:, 0]
            from slimectl.backends.megatron.attention import packed_segments

            with packed_segments(mb.segment_lengths):
                critic_h = critic.hidden_states(mb.input_ids, mb.position_ids, None)[:, 0]
            assert torch.equal(actor_h, critic_h)
            # the value head starts at zero: every first value is exactly 0
            v0 = {s.sample_index: v for s, v in zip(mb.seqs, response_values(critic, mb))}
            assert [v0[i].shape[0] for i in range(3)] == [3, 1, 5]
            assert all(bool((v == 0).all()) for v in v0.values())
            # with a head set by hand: V = h[rows] @ w + b at the rows that predict each response token
            w = torch.linspace(-1, 1, H)
            critic.value_head.weight.copy_(w.unsqueeze(0))
            critic.value_head.bias.fill_(0.25)
            rows, _, counts = response_positions(mb)
            expect = (actor_h[rows] @ w + 0.25).split(counts)
            got = {s.sample_index: v for s, v in zip(mb.seqs, response_values(critic, mb))}
            for s, e in zip(mb.seqs, expect):
                torch.testing.assert_close(got[s.sample_index], e, atol=1e-5, rtol=0)
            values = padded_values(got, 3)
            assert tuple(values.shape) == (3, 5)  # [B, T], right-padded
            assert values[1, 1:].abs().sum() == 0 and values[0, 3:].abs().sum() == 0
        mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)

        # one Adam step on the clipped value loss towards fixed returns lowers it
        old = values.detach().clone()
        returns = old + torch.tensor([[0.1, -0.1, 0.1, 0, 0], [-0.1, 0, 0, 0, 0], [0.1, 0.1, -0.1, -0.1, 0.1]])
        opt = torch.optim.Adam(critic.parameters(), lr=1e-5)  # Adam moves every weight by ~lr at its first step

        def loss_now():
            per = {s.sample_index: v for s, v in zip(mb.seqs, response_values(critic, mb))}
            return clipped_value_loss(padded_values(per, 3), old, returns, mask, value_clip=0.2)

        before = loss_now()
        opt.zero_grad()
        before.loss.backward()
        assert critic.value_head.weight.grad.abs().sum() > 0
        trunk_grad = sum(float(p.grad.abs().sum()) for p in critic.gpt.parameters() if p.grad is not None)
        assert trunk_grad > 0  # the head is non-zero now, so the transformer learns too
        opt.step()
        with torch.no_grad():
            after = loss_now()
        assert float(after.loss) < 0.9 * float(before.loss)  # measured: 0.0100 -> 0.0069
        # before the step V = V_old, so every loss token's error is (+-0.1)^2: each sample's mean is 0.01
        assert float(before.loss) == pytest.approx(0.01, rel=1e-4)


def test_critic_steps_per_rollout_pass_over_every_global_batch_clipped_around_the_rollout_values(tiny_llama):
    """critic.num_steps_per_rollout = 3 (verl's critic ppo_epochs): three passes over the actor's two global
    batches = 6 critic steps, one metrics dict per batch, the LR horizon in critic steps, and the value clip
    around the rollout-time V_old in every pass (the values end more than value_clip from it)."""
    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.megatron.critic_trainer import MegatronCritic
    from slimectl.backends.megatron.parallel import init_parallel
    from slimectl.contract.config_schema import AlgorithmSection, CriticSection, TrainSection

    with in_process_stage():
        init_parallel(tp=1, pp=1, seed=7)
        arch = arch_from_dir(tiny_llama)
        critic = MegatronCritic(arch, arch.padded_vocab_size(1), TrainSection(lr=1e-3, max_tokens_per_micro_batch=64),
                                CriticSection(lr=1e-2, min_lr=0.0, lr_decay_style="linear", lr_warmup_steps=0,
                                              value_clip=0.05, num_steps_per_rollout=3),
                                AlgorithmSection(advantage_estimator="ppo"), total_steps=4)
        critic.load_hf(tiny_llama)
        assert critic.model.scheduler.lr_decay_steps == 12  # 4 actor steps x 3 critic steps each
        masks = [torch.ones(s.response_length) for s in SAMPLES]
        old = critic.values(SAMPLES)
        returns = [v + 1.0 for v in old]
        out = critic.train_on_returns(SAMPLES, [[0, 1], [2]], masks, old, returns)
        assert len(out) == 2 and critic.step == 6 and [m["critic/step"] for m in out] == [5.0, 6.0]
        assert out[0]["critic/lr"] == pytest.approx(1e-2) and out[1]["critic/lr"] < out[0]["critic/lr"]
        new = critic.values(SAMPLES)
        moved = min(float((n - o).min()) for n, o in zip(new, old))
        assert moved > 0.05  # every value rose past value_clip: later passes went on from the moved values
        assert all(m["critic/value_clipfrac"] > 0 for m in out)  # later passes: |V - V_old| > value_clip
