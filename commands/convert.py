"""``slimectl convert``: HF checkpoint -> Megatron torch_dist checkpoint."""

from __future__ import annotations

import click

from slimectl.commands._options import force_option, resolve_run_dir, run_dir_option


@click.command("convert", short_help="Convert an HF model to a Megatron torch_dist checkpoint.")
@click.option("--hf", "hf_dir", type=click.Path(file_okay=False),
              help="HF model directory (default with -r: the run's model.path).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="Output checkpoint directory (default with -r: RUN/checkpoints/000000).")
@run_dir_option
@click.option("--tp", default=1, show_default=True, type=click.IntRange(min=1), help="Tensor-parallel size.")
@click.option("--pp", default=1, show_default=True, type=click.IntRange(min=1), help="Pipeline-parallel size.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="Parameter dtype of the checkpoint.")
@force_option("Replace an existing output.")
@click.pass_context
def convert_cmd(ctx: click.Context, hf_dir: str | None, out_dir: str | None, run_dir: str | None, tp: int, pp: int,
                dtype: str, force: bool) -> None:
    """Convert an HF safetensors model (Llama, Qwen2, Qwen3, Qwen3-MoE, GLM-4.5) to a Megatron torch_dist checkpoint.

    The result loads in Megatron-LM (--ckpt-format torch_dist; tracker "release") and in
    `slimectl train`, at any TP/PP. With --tp/--pp > 1 the command launches tp*pp processes
    with torchrun itself (or runs as one of them when started under torchrun).

    \b
    Examples:
      slimectl convert --hf Qwen2.5-0.5B --out ckpt/qwen --tp 2
      slimectl convert -r runs/a            # the run's model.path -> RUN/checkpoints/000000
    """
    from slimectl.contract.errors import UsageError
    from slimectl.contract.ranks import launch_rank, under_torchrun
    from slimectl.orchestration.torchrun import argv_from_params, relaunch_under_torchrun
    from slimectl.stages.convert import check_convert_inputs, convert_hf_to_megatron

    run = resolve_run_dir(ctx, run_dir)
    if out_dir is None and run is None:
        raise UsageError("pass --out DIR, or -r RUN to publish into a run directory")
    if out_dir is not None and run is not None and run_dir is None:
        run = None  # an explicit --out wins over a run dir inherited from the root/env
    if hf_dir is None:
        if run is None:
            raise UsageError("pass --hf DIR (the HF model to convert)")
        from slimectl.contract.rundir import RunDir

        hf_dir = RunDir.open(run).config().model.path
    if tp * pp > 1 and not under_torchrun():
        check_convert_inputs(hf_dir, out_dir, tp, pp, dtype, force, run if out_dir is None else None)
        argv = argv_from_params(ctx.command.params, {**ctx.params, "hf_dir": str(hf_dir),
                                                     "run_dir": str(run) if out_dir is None else None})
        code = relaunch_under_torchrun(tp * pp, ["convert", *argv])
        if code:
            ctx.exit(code)
        return
    result = convert_hf_to_megatron(hf_dir, out_dir, tp=tp, pp=pp, dtype=dtype, force=force,
                                    run_dir=run if out_dir is None else None)
    if launch_rank() == 0:
        click.echo(str(result.out))
