"""``slimectl export``: Megatron torch_dist checkpoint -> HF safetensors."""

from __future__ import annotations

import click


@click.command("export", short_help="Export a Megatron checkpoint to HF safetensors.")
@click.option("--checkpoint", type=click.Path(file_okay=False), help="Megatron checkpoint directory.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Output HF directory.")
def export_cmd(checkpoint: str | None, out_dir: str | None) -> None:
    """Export a Megatron torch_dist checkpoint to an HF directory that from_pretrained loads."""
    from slimectl.errors import NotAvailableYet

    raise NotAvailableYet("`slimectl export` is not available yet in this release (tracked in issue #3)")
