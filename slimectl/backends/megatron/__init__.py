"""The Megatron backend: real megatron-core, on GPUs with NCCL and on CPUs with gloo.

Everything that imports megatron lives in this package; the rest of slimectl talks to it
through :mod:`slimectl.backends.megatron.checkpoint` (convert/export/train) and the model provider.
Whatever imports megatron first in a process, the import goes through :mod:`.importing` (installed
here, before any module of this package runs): no import-time torch.compile on CPU, no wandb.
"""

import warnings as _warnings

from slimectl.backends.megatron import importing as _importing

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

_importing.install()
