"""``slimectl train``: train the Megatron actor on READY rollouts, each exactly once."""

from __future__ import annotations

import click

from slimectl.commands._options import stage_options


@click.command("train", short_help="Train the Megatron actor on READY rollouts, each exactly once.")
@stage_options
@click.option("--id", "rollout_id", type=click.IntRange(min=0), help="Train on this rollout only (must be the next one).")
@click.option("--follow", is_flag=True, help="Wait for rollouts that are not published yet, and publish weights/N "
              "after each one (multi-machine use; with `rollout --follow` and `sync --follow`: fully async).")
@click.option("--max-rollouts", type=click.IntRange(min=1), help="Stop after this many rollouts.")
@click.option("--wait-timeout", type=float, help="With --follow: give up after this many seconds per rollout.")
@click.option("--allow-empty", is_flag=True, help="Exit 0 when there is nothing left to train.")
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Nodes the tp*pp*dp ranks are spread over (run the same command on each node).")
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True, help="This node's rank (0..nnodes-1).")
@click.option("--master-addr", help="With --nnodes > 1: node 0's address, reachable from every node.")
@click.option("--master-port", type=click.IntRange(1, 65535), help="With --nnodes > 1: a free port on node 0.")
@click.pass_context
def train_cmd(ctx: click.Context, run_dir: str | None, overrides: tuple[str, ...], dry_run: bool, rollout_id: int | None,
              follow: bool, max_rollouts: int | None, wait_timeout: float | None, allow_empty: bool, nnodes: int,
              node_rank: int, master_addr: str | None, master_port: int | None) -> None:
    """Train on rollouts from the consumption cursor onward.

    Saves checkpoints/N and weights/N every train.save_interval rollouts and after the last one;
    a rerun after a crash resumes from the last checkpoint and trains nothing twice.

    \b
    Examples:
      slimectl train -r runs/a
      slimectl train -r runs/a --follow          # wait for rollouts produced elsewhere
      slimectl train -r runs/a --follow --set train.dp=16 --nnodes 2 --node-rank 0 \\
          --master-addr 10.0.0.1 --master-port 29500  # and --node-rank 1 on the second node

    With train.tp*pp*dp > 1 it relaunches itself under torchrun (8 ranks per node on 2 nodes for
    dp=16 above); launching `torchrun ... -m slimectl train` yourself works as well.
    """
    from slimectl.commands._stage import open_stage
    from slimectl.contract.ranks import under_torchrun
    from slimectl.orchestration.torchrun import check_node_options, relaunch_stage
    from slimectl.stages.train.plan import plan_training

    opened = open_stage(ctx, "train", run_dir, overrides, dry_run)
    if opened is None:
        return
    run, cfg = opened
    world = cfg.train.world_size
    if nnodes > 1 and world % nnodes:
        raise click.UsageError(f"--nnodes {nnodes} must divide train.tp*pp*dp = {world} (ranks per node)")
    call = dict(rollout_id=rollout_id, follow=follow, max_rollouts=max_rollouts, allow_empty=allow_empty,
                wait_timeout=wait_timeout)
    if world > 1 and not under_torchrun():
        check_node_options(nnodes, node_rank, master_addr, master_port)
        # Fail here, in a second, not on every rank after building the actor.
        plan_training(run, cfg, rollout_id, follow, max_rollouts, allow_empty, check_published=node_rank == 0)
        # every rank: the config open_stage saved as RUN/configs/train.yaml, and this call
        code = relaunch_stage("train", world // nnodes, run.path, call, cfg.fingerprint(), nnodes, node_rank,
                              master_addr, master_port)
        if code:
            ctx.exit(code)
        return
    train_here(run, cfg, **call)


def train_here(run, cfg, **call) -> None:
    """Train in this process (the only one, or one rank of torchrun's); rank 0 prints what it trained."""
    from slimectl.commands._stage import format_ids
    from slimectl.contract.ranks import launch_rank
    from slimectl.stages.train.stage import run_train  # (torch and megatron: only where the trainer runs)

    result = run_train(run, cfg, **call)
    if launch_rank() == 0:
        click.echo(f"trained rollouts {format_ids(result.trained)}; weight version {result.weight_version}")
