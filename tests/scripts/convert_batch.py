"""Convert several HF models in one launch (saves the import cost per model in tests).

    [torchrun --nproc_per_node N] convert_batch.py TP PP HF_DIR OUT [HF_DIR OUT ...]

With SLIMECTL_TEST_READ_ALL=1 every tensor is read into memory and written by torch_dist's
writer (no tensor is copied from the HF files), to compare both paths.
"""

import json
import os
import sys

from slimectl.stages.convert import convert_hf_to_megatron


def main() -> None:
    tp, pp, pairs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    from slimectl.backends.megatron.copy_save import RowSource

    accepts = RowSource.accepts
    if os.environ.get("SLIMECTL_TEST_READ_ALL") == "1":
        RowSource.accepts = lambda self, name: False
    forks, copied = [], []
    os.register_at_fork(before=lambda: forks.append(1))  # the save writes from this process
    try:
        for hf, out in zip(pairs[::2], pairs[1::2]):
            copied.append(convert_hf_to_megatron(hf, out, tp=tp, pp=pp, progress="off").copied_tensors)
    finally:
        RowSource.accepts = accepts  # run in-process by the tests: leave the class as it was
    print("RESULT " + json.dumps({"forks": len(forks), "copied": copied}))


if __name__ == "__main__":
    main()
