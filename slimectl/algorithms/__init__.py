"""RL post-training math in slime's definitions: pure functions over torch tensors.

Representation: padded ``[B, T]`` per-token tensors (response tokens, right-padded) plus a mask
of the same shape (slime's ``loss_mask``); per-sample values are ``[B]``. Only ``torch`` is
imported (``tests/unit/test_walls.py`` enforces it), and this package file imports nothing, so the
config can read :mod:`.registry` without loading torch.

Modules: :mod:`.registry` (every choice name and default, no torch), :mod:`.objective` (the
per-micro-batch loss and metrics the trainer backpropagates), :mod:`.rewards` (group reward
normalization), :mod:`.advantages` (GRPO/GSPO/CISPO, REINFORCE++, REINFORCE++-baseline,
whitening), :mod:`.kl` (k1/k2/k3/low_var_kl), :mod:`.policy_loss` (PPO clip, clip-higher, dual
clip, GSPO, CISPO, entropy, SFT), :mod:`.tis` (truncated importance sampling, the train/rollout mismatch metric),
:mod:`.opd` (on-policy distillation shaping), :mod:`.reduce` (per-sample vs per-token reduction),
:mod:`.gae` (PPO: token rewards, GAE advantages and returns), :mod:`.value_loss` (the critic's clipped
value loss, explained variance, ``critic/*`` metrics), :mod:`.staleness` (which groups of a rollout are too
many weight versions old to train on).
"""
