"""Export several Megatron checkpoints to HF in one process.

    export_batch.py CKPT OUT [CKPT OUT ...]
"""

import sys

from slimectl.stages.export import export_megatron_to_hf


def main() -> None:
    pairs = sys.argv[1:]
    for ckpt, out in zip(pairs[::2], pairs[1::2]):
        export_megatron_to_hf(ckpt, out, progress="off")


if __name__ == "__main__":
    main()
