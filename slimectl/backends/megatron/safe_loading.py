"""Loading a torch_dist checkpoint runs no code from it, and a damaged one fails in one line naming it."""

from __future__ import annotations

from pathlib import Path

import torch

from slimectl.contract.errors import MegatronCheckpointError, SlimectlError, UsageError

# A torch_dist checkpoint is data a user may receive from anyone (a shared run directory, a
# download), so loading one must run no code from it. Three places in torch/megatron unpickle
# checkpoint files: torch's ``FileSystemReader.read_metadata`` (plain ``pickle.load`` of
# ``.metadata``), torch's ``DefaultLoadPlanner.load_bytes`` (``torch.load(weights_only=False)`` of
# the byte items inside ``*.distcp``: RNG states, optimizer groups) and megatron's common strategy
# (``torch.load`` of ``common.pt`` and ``*.pt`` sharded objects, weights_only by torch's default).
# ``install_safe_loading`` makes the first an allow-list unpickler and the other two weights_only,
# for the whole process, and wraps megatron's load entry points so that any failure to read a
# checkpoint (torch's CheckpointException is a BaseException) becomes one line naming it.

_SAFE_METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.planner": frozenset({
        "SavePlan", "LoadPlan", "WriteItem", "ReadItem", "WriteItemType", "LoadItemType", "TensorWriteData",
        "BytesIOWriteData"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.serialization": frozenset({"_get_layout"}),  # torch.strided & co. pickle as _get_layout("torch.strided")
    "torch": frozenset({"Size"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice", "complex", "tuple", "list", "dict", "bytearray"}),
    # megatron's stand-ins for older checkpoints' classes (plain containers)
    "megatron.core.dist_checkpointing.strategies.torch": frozenset({"MCoreMetadata", "MCoreSavePlan"}),
}


class UnsafeCheckpoint(MegatronCheckpointError, UsageError):
    """A checkpoint file would make the loader run code or build objects it has no business building."""

    exit_code = 2


def _metadata_unpickler(file, where: str):
    import pickle

    class _Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if name in _SAFE_METADATA_GLOBALS.get(module, ()):
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                              torch.memory_format)):
                return getattr(torch, name)
            raise UnsafeCheckpoint(
                f"{where}: refused to load: it would call {module}.{name}, which is not a torch_dist metadata "
                f"class (slimectl runs no code from checkpoints); the checkpoint is damaged or malicious: "
                f"get it again from a source you trust, or re-create it with `slimectl convert`/`train`")

    return _Restricted(file)


class _SafePickle:
    """``pickle`` as torch's checkpoint filesystem module sees it: loads through the allow-list."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def load(self, file, **_kw):
        return _metadata_unpickler(file, getattr(file, "name", None) or ".metadata").load()

    def loads(self, data, **_kw):
        import io

        return _metadata_unpickler(io.BytesIO(data), ".metadata").load()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _load_failure(it_dir, exc: BaseException) -> SlimectlError:
    """One line for a checkpoint that could not be read: its own SlimectlError if one was raised
    inside (the refused pickle), else the first cause, naming the directory and what to do."""
    causes: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    for pair in (getattr(exc, "failures", None) or {}).values():
        todo.append(pair[0] if isinstance(pair, tuple) else pair)
    while todo:
        err = todo.pop(0)
        if err is None or err in causes:
            continue
        causes.append(err)
        todo += [err.__cause__, err.__context__]
        for pair in (getattr(err, "failures", None) or {}).values() if hasattr(err, "failures") else ():
            todo.append(pair[0] if isinstance(pair, tuple) else pair)
    for err in causes:
        if isinstance(err, SlimectlError):
            return err
    import pickle

    for err in causes:
        if isinstance(err, pickle.UnpicklingError) and "weights only" in str(err).lower():
            return UnsafeCheckpoint(
                f"{it_dir}: refused to load: a file there holds objects other than tensors and plain values "
                f"({str(err).strip().splitlines()[0][:200]}; slimectl runs no code from checkpoints); the checkpoint "
                f"is damaged or malicious: get it again from a source you trust, or re-create it with "
                f"`slimectl convert`/`train`")
    real = [e for e in causes if not type(e).__name__.startswith("CheckpointException")] or causes
    return MegatronCheckpointError(
        f"cannot load the torch_dist checkpoint {it_dir}: {_first_line(real[-1])}; "
        f"it is damaged or incomplete (a missing or truncated file), or saved for another model: "
        f"re-create it (`slimectl convert`/`train`) or pick another checkpoint")


def check_torch_dist_metadata(it_dir: str | Path) -> None:
    """Read ``IT_DIR/.metadata`` through the allow-list before torch does (torch would log a
    traceback for an unreadable one and fall back to per-rank files): a refused class, a damaged
    or missing file is one line naming it. Cheap: the file is a few KB."""
    import pickle

    path = Path(it_dir) / ".metadata"
    fix = "re-create the checkpoint (`slimectl convert`/`train`) or pick another one"
    if not path.is_file():
        raise MegatronCheckpointError(f"{path} is missing: {it_dir} is not a complete torch_dist checkpoint; {fix}")
    try:
        with open(path, "rb") as f:
            _metadata_unpickler(f, str(path)).load()
    except SlimectlError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            ImportError, UnicodeDecodeError, OverflowError, MemoryError) as exc:
        raise MegatronCheckpointError(f"{path} is damaged ({_first_line(exc)}); {fix}") from None
    except OSError as exc:
        raise MegatronCheckpointError(f"cannot read {path}: {exc.strerror or exc}; {fix}") from None


def _guard_load(fn):
    import functools

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        it_dir = kwargs.get("checkpoint_dir", args[1] if fn.__name__ == "load" and len(args) > 1
                            else args[0] if args else "?")
        try:
            if fn.__name__ in ("load", "load_tensors_metadata", "load_sharded_metadata", "load_plain_tensors"):
                check_torch_dist_metadata(it_dir)
            return fn(*args, **kwargs)
        except SlimectlError:
            raise
        except (Exception, _checkpoint_exception()) as exc:  # CheckpointException is a BaseException
            raise _load_failure(it_dir, exc) from None

    guarded._slimectl_guarded = True  # type: ignore[attr-defined]
    return guarded


def _checkpoint_exception():
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _load_bytes_weights_only(self, read_item, value) -> None:
    """torch's ``DefaultLoadPlanner.load_bytes`` with ``weights_only=True`` (tensors, containers,
    plain values and megatron's registered safe classes; no code)."""
    from torch.distributed.checkpoint._traverse import set_element

    obj = torch.load(value, weights_only=True)
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


def install_safe_loading() -> None:
    """Make every torch_dist load in this process safe and its failures one line (idempotent).

    Called when this module is imported, which every Megatron load in slimectl is preceded by
    (convert/export/train import it before building a model), and again by the load functions.
    """
    import torch.distributed.checkpoint.default_planner as dp
    import torch.distributed.checkpoint.filesystem as fs
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import serialization

    if not isinstance(fs.pickle, _SafePickle):
        fs.pickle = _SafePickle(fs.pickle)
    if dp.DefaultLoadPlanner.load_bytes is not _load_bytes_weights_only:
        dp.DefaultLoadPlanner.load_bytes = _load_bytes_weights_only
    for name in ("load", "load_common_state_dict", "load_tensors_metadata", "load_sharded_metadata",
                 "load_plain_tensors", "load_content_metadata"):
        for mod in (dc, serialization):
            fn = getattr(mod, name, None)
            if fn is not None and not getattr(fn, "_slimectl_guarded", False):
                setattr(mod, name, _guard_load(fn))


install_safe_loading()
