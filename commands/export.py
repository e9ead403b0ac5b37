"""``slimectl export``: Megatron torch_dist checkpoint -> HF safetensors."""

from __future__ import annotations

import click

from slimectl.commands._options import force_option, resolve_run_dir, run_dir_option


@click.command("export", short_help="Export a Megatron checkpoint to HF safetensors.")
@click.option("--checkpoint", type=click.Path(file_okay=False),
              help="Megatron checkpoint root (default with -r: the run's latest READY checkpoint).")
@click.option("--iteration", type=click.IntRange(min=0),
              help="Iteration to export (default: the tracker's; with -r: the checkpoint artifact id).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="Output HF directory (default with -r: RUN/weights/ID).")
@run_dir_option
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), help="Output dtype (default: the checkpoint's).")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest safetensors shard, e.g. 500MB.")
@force_option("Replace an existing output.")
@click.pass_context
def export_cmd(ctx: click.Context, checkpoint: str | None, iteration: int | None, out_dir: str | None,
               run_dir: str | None, dtype: str | None, max_shard_size: str, force: bool) -> None:
    """Export a torch_dist checkpoint (saved at any TP/PP) to an HF directory that
    AutoModelForCausalLM.from_pretrained loads unchanged (config and tokenizer included).

    \b
    Examples:
      slimectl export --checkpoint ckpt/qwen --out qwen-hf
      slimectl export -r runs/a --iteration 20 --out exported/
    """
    from slimectl.stages.export import export_megatron_to_hf

    run = resolve_run_dir(ctx, run_dir)
    if checkpoint is not None and out_dir is not None and run_dir is None:
        run = None  # explicit paths win over a run dir inherited from the root/env
    result = export_megatron_to_hf(checkpoint, out_dir, iteration=iteration, dtype=dtype,
                                   max_shard_size=max_shard_size, force=force, run_dir=run)
    click.echo(str(result.out))
