"""``slimectl convert``: HF checkpoint -> Megatron torch_dist checkpoint."""

from __future__ import annotations

import click


@click.command("convert", short_help="Convert an HF model to a Megatron torch_dist checkpoint.")
@click.option("--hf", "hf_dir", type=click.Path(file_okay=False), help="HF model directory.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Output checkpoint directory.")
def convert_cmd(hf_dir: str | None, out_dir: str | None) -> None:
    """Convert an HF safetensors model to a Megatron torch_dist checkpoint (TP/PP aware)."""
    from slimectl.errors import NotAvailableYet

    raise NotAvailableYet("`slimectl convert` is not available yet in this release (tracked in issue #3)")
