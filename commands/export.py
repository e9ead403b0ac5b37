"""``slimectl export``: Megatron torch_dist checkpoint -> HF safetensors."""

from __future__ import annotations

import click

from slimectl.commands._options import force_option, resolve_run_dir, run_dir_option


@click.command("export", short_help="Export a Megatron checkpoint to HF safetensors.")
@click.option("--checkpoint", type=click.Path(file_okay=False),
              help="Checkpoint to export: a convert output, or a run's RUN/checkpoints/N "
                   "(default with -r: the run's newest READY checkpoint).")
@click.option("--id", "checkpoint_id", type=click.IntRange(min=0),
              help="With -r: export RUN/checkpoints/ID (default: the newest READY one).")
@click.option("--iteration", type=click.IntRange(min=0),
              help="Iteration of a Megatron checkpoint root (default: its tracker's); with -r and no "
                   "--checkpoint, the same as --id.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="Output HF directory (default with -r, or a run's checkpoints/N: RUN/exports/N; "
                   "the run's weights/N are never replaced).")
@run_dir_option
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), help="Output dtype (default: the checkpoint's).")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest safetensors shard, e.g. 500MB.")
@click.option("--merge", is_flag=True,
              help="A LoRA run's checkpoint: write its base with the adapter merged in (full HF weights) instead "
                   "of the PEFT adapter.")
@force_option("Replace an existing output.")
@click.pass_context
def export_cmd(ctx: click.Context, checkpoint: str | None, checkpoint_id: int | None, iteration: int | None,
               out_dir: str | None, run_dir: str | None, dtype: str | None, max_shard_size: str, merge: bool,
               force: bool) -> None:
    """Export a torch_dist checkpoint (saved at any TP/PP, by convert or train) to an HF directory
    that AutoModelForCausalLM.from_pretrained loads unchanged (config and tokenizer included); a
    LoRA run's checkpoint exports as a PEFT adapter (PeftModel.from_pretrained), or merged with --merge.
    Prints the output directory.

    \b
    Examples:
      slimectl export -r runs/a                  # newest checkpoint -> runs/a/exports/NNNNNN
      slimectl export -r runs/a --id 20 --out qwen-trained
      slimectl export --checkpoint runs/a/checkpoints/000020
      slimectl export --checkpoint ckpt/qwen --out qwen-hf
      slimectl export -r runs/lora --merge       # a LoRA run: base + adapter -> full HF weights
    """
    from slimectl.stages.export import export_megatron_to_hf

    run = resolve_run_dir(ctx, run_dir)
    if checkpoint is not None and run_dir is None:
        run = None  # an explicit checkpoint wins over a run dir inherited from the root/env
    result = export_megatron_to_hf(checkpoint, out_dir, iteration=iteration, dtype=dtype,
                                   max_shard_size=max_shard_size, force=force, run_dir=run,
                                   checkpoint_id=checkpoint_id, merge=merge)
    click.echo(str(result.out))
