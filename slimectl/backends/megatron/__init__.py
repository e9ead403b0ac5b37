"""The Megatron backend: real megatron-core, on GPUs with NCCL and on CPUs with gloo.

Everything that imports megatron lives in this package; the rest of slimectl talks to it
through :mod:`slimectl.backends.megatron.checkpoint` (convert/export/train) and the model provider.
"""

import warnings as _warnings

# megatron-core announces every missing optional accelerator (Transformer Engine, Apex) at import
# time; on CPU that is expected, so keep stderr for what matters.
for _pattern in (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
    r"`load_state_dict` is deprecated",
    r"Please use DTensor instead",
):
    _warnings.filterwarnings("ignore", message=_pattern)
