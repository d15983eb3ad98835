"""Reading distributed checkpoints (`torch.distributed.checkpoint`) without running code.

DCP stores tensors with `torch.save` (read back with `weights_only=True`), but two parts of
its reader unpickle freely: the `.metadata` file (`pickle.load`) and non-tensor values
such as optimizer hyper-parameters (`torch.load(weights_only=False)` in
`DefaultLoadPlanner.load_bytes`). A checkpoint from someone else could run code through
either. `SafeReader` and `SafePlanner` close both: the metadata unpickler accepts only
DCP's own metadata classes and torch's sizes and dtypes, and the values go through
`weights_only=True`. Every DCP read in llmsplit goes through them.
"""

from __future__ import annotations

import enum
import io
import pickle
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo

from .run_dir import METADATA_FILE


class UnsafeCheckpoint(ValueError):
    """The metadata names a Python object outside what a DCP checkpoint may contain."""


def _allowed(module: str, name: str) -> bool:
    if module == dcp_metadata.__name__:
        return isinstance(getattr(dcp_metadata, name, None), type)
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    return (module, name) in {
        (_StorageInfo.__module__, _StorageInfo.__name__),
        ("torch.serialization", "_get_layout"),  # how torch pickles a layout (torch.strided)
        ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),  # the checkpoint id DCP records
        ("collections", "OrderedDict"),
    }


def _enum_member(cls, name: str):
    """What `builtins.getattr` may do in a checkpoint's metadata: name a member of one of DCP's
    own enums (tensors' memory format). Some Pythons (Debian's 3.11.2, for one) pickle an
    enum member as getattr(EnumClass, name); a plain getattr would let a file reach any
    attribute of anything the unpickler accepts."""
    if (isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__ == dcp_metadata.__name__
            and isinstance(name, str) and name in cls.__members__):
        return cls[name]
    raise UnsafeCheckpoint(f"{METADATA_FILE} calls getattr on {cls!r}, which a checkpoint never does")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if not _allowed(module, name):
            raise UnsafeCheckpoint(f"{METADATA_FILE} refers to {module}.{name}, which a checkpoint never contains")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        with open(Path(self.path) / METADATA_FILE, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UnsafeCheckpoint(f"{METADATA_FILE} holds a {type(metadata).__name__}, not DCP metadata")
        _check_inside(metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_inside(metadata: dcp_metadata.Metadata) -> None:
    """Every data file the metadata names must be a plain file name inside the checkpoint
    folder: DCP joins the name to the folder, so "../x" or "/etc/passwd" would be opened
    wherever it points. DCP itself only ever writes flat names (`__0_0.distcp`)."""
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise UnsafeCheckpoint(f"{METADATA_FILE} names the data file {name!r}, which is not a file inside the "
                                   f"checkpoint folder")


class SafePlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        # The same as DefaultLoadPlanner.load_bytes, with weights_only=True.
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class CheckpointFailed(RuntimeError):
    """A DCP save or load failed; the message names the first rank that failed and its error."""


@contextmanager
def plain_errors(doing: str):
    """DCP reports a failed save or load as a CheckpointException, which derives from
    BaseException: torch's error recording (`record`) and multiprocessing's worker wrapper
    catch only Exception, so a worker dying of one was reported as "exit code 1" and its
    message lost. Raise a plain exception instead (the original stays its __cause__)."""
    try:
        yield
    except CheckpointException as e:
        rank, (error, _) = min(e.failures.items())
        raise CheckpointFailed(f"{doing} failed on rank {rank}: {type(error).__name__}: {error}") from e


def load(state: dict, path: str | Path) -> None:
    """`dcp.load` in place, through the safe reader and planner."""
    with plain_errors(f"loading {path}"):
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner())


def read_metadata(path: str | Path) -> dcp_metadata.Metadata:
    return SafeReader(str(path)).read_metadata()


def storage_problem(path: str | Path, metadata: dcp_metadata.Metadata) -> str | None:
    """What is missing from the data files the metadata points at (a crash or a copy cut
    short leaves them shorter than recorded), or None."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = Path(path) / name
        if not file.is_file():
            return f"data file {name} is missing"
        if file.stat().st_size < size:
            return f"data file {name} is truncated ({file.stat().st_size} bytes, the metadata needs {size})"
    return None


def saved_model_shapes(metadata: dcp_metadata.Metadata, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of every model tensor a checkpoint's metadata records (no data read)."""
    return {k[len(prefix):]: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and hasattr(v, "size")}
