"""Convert several HF models in one launch (saves the import cost per model in tests).

    [torchrun --nproc_per_node N] convert_batch.py TP PP HF_DIR OUT [HF_DIR OUT ...]
"""

import sys

from slimectl.convert import convert_hf_to_megatron


def main() -> None:
    tp, pp, pairs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    for hf, out in zip(pairs[::2], pairs[1::2]):
        convert_hf_to_megatron(hf, out, tp=tp, pp=pp, progress="off")


if __name__ == "__main__":
    main()
