"""Convert several HF models in one launch (saves the import cost per model in tests).

    [torchrun --nproc_per_node N] convert_batch.py TP PP HF_DIR OUT [HF_DIR OUT ...]
"""

import json
import os
import sys

from slimectl.convert import convert_hf_to_megatron


def main() -> None:
    tp, pp, pairs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    forks = []
    os.register_at_fork(before=lambda: forks.append(1))  # the save writes from this process
    for hf, out in zip(pairs[::2], pairs[1::2]):
        convert_hf_to_megatron(hf, out, tp=tp, pp=pp, progress="off")
    print("RESULT " + json.dumps({"forks": len(forks)}))


if __name__ == "__main__":
    main()
