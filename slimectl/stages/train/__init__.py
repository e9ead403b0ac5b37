"""``slimectl train``: consume READY rollouts exactly once, train the Megatron actor, checkpoint, publish.

One module per job:

- :mod:`~slimectl.stages.train.plan` — which rollouts an invocation trains and where training resumes, checked
  before anything expensive is built;
- :mod:`~slimectl.stages.train.trainer` — :class:`~slimectl.stages.train.trainer.Trainer`: the actor resumed
  from the run directory (the cursor reconciled with the last checkpoint), trained one rollout at a time;
- :mod:`~slimectl.stages.train.ppo` — PPO's rollout (the critic's values, GAE, actor and critic steps) and the
  critic's construction;
- :mod:`~slimectl.stages.train.publish` — ``weights/N`` and ``checkpoints/N`` (with ``critic_checkpoints/N``);
- :mod:`~slimectl.stages.train.writer` — the ordered background writer of checkpoints;
- :mod:`~slimectl.stages.train.stage` — :func:`~slimectl.stages.train.stage.run_train`, what the command calls.

Version numbering: training on rollout N produces weight version N+1. After rollout N the stage commits the
consumption cursor (``cursors/train.json``); every ``train.save_interval`` rollouts (and after the last one) it
publishes ``checkpoints/N+1`` (model + optimizer + step, torch_dist) and ``weights/N+1`` (HF safetensors for disk
sync). ``checkpoints/000000`` is the initial policy written by ``slimectl convert -r``.

Resume: a rerun loads the latest checkpoint the trainer wrote, rewinds the cursor to it when training after it
was lost in a crash (recorded in the cursor's ``rewinds``), and goes on — a rollout's effect is in the model
exactly once.
"""
