"""Where a ModelGraph's tensors live, so that a model larger than RAM fits in the IR.

    store = TensorStore(base, spill=SpillFile())   base: the checkpoint's tensors, a Mapping that reads each one
                                                   from disk when asked (optimizer.loader.CheckpointTensors)
    store[name]                  the overlay's entry if a pass replaced it, else the base's
    store[name] = t              an overlay entry; with a spill file, a tensor of `SpillFile.threshold` bytes or
                                 more is written there at once and read back on access
    store.copy()                 the overlay copied shallowly (snapshots and restores cost nothing)
    store.info(name)             (dtype, shape) without reading the data
    store.entry(name)            what `name` is stored as: the same object until the entry is replaced (what
                                 the calibrator compares to know whether a block changed)

Reading returns a new tensor, but the same one again while anyone holds it (a weak cache), so identity checks
(`store[n] is t`) hold as they do for a dict, and memory is only what callers keep. Entries are never changed in
place: a spilled tensor's bytes are written once and read back bit for bit.

The spill file is an anonymous temporary file in TMPDIR, so the operating system frees its disk space when the
last store using it is gone, even if the process dies. TMPDIR must be on disk: on a tmpfs the spill is RAM.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import NamedTuple

import torch

MMAP_THRESHOLD = 4 << 20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def bound_heap() -> None:
    """Give every allocation of MMAP_THRESHOLD bytes or more its own mapping, returned to the system when freed
    (glibc's mallopt). By default glibc raises that threshold to the largest block freed so far (up to 32 MiB),
    so a streaming build's activations and per-linear buffers of 4-32 MiB land in the heap, whose holes then grow
    a block's peak block after block: an 8B-shaped build's per-block peak went from 3.3 GiB at block 0 to
    4.1 GiB from block 9 on, with the same 0.77 GiB live between blocks; with this threshold it stayed at
    3.8 GiB or less over blocks 0-13 (and the whole build, with GPTQ's Hessian consumed, peaked at 3.68 GiB).
    Elsewhere than glibc: nothing."""
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim): called between blocks of a streaming
    build, so memory freed by one block is not kept beside the next one's. Elsewhere than glibc: nothing."""
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)


RELEASE_EVERY = 256 << 20


def releasing(names: list[str], nbytes: Callable[[str], int], every: int = RELEASE_EVERY) -> Iterator[str]:
    """`names` in order, releasing freed memory after every `every` bytes' worth of them (a tensor-by-tensor
    pass over a whole checkpoint: validation, writing)."""
    done = 0
    for name in names:
        yield name
        done += nbytes(name)
        if done >= every:
            release_freed_memory()
            done = 0


SPILL_BYTES = 1 << 20  # smaller replaced tensors stay in memory: norms, biases, scales (their sum is small)
# safetensors' dtype names (its header's "dtype") and the torch dtypes they hold
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                      "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64,
                      "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
                      "F8_E8M0": torch.float8_e8m0fnu}  # MXFP4 scales of some pre-quantized checkpoints


class TensorInfo(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @staticmethod
    def of(t: torch.Tensor) -> TensorInfo:
        return TensorInfo(t.dtype, tuple(t.shape))


def tensor_info(tensors: Mapping[str, torch.Tensor], name: str) -> TensorInfo:
    """The dtype and shape of `tensors[name]`, without reading it when the mapping can say (an `info` method)."""
    info = getattr(tensors, "info", None)
    return info(name) if info is not None else TensorInfo.of(tensors[name])


def read_tensor(fd: int, offset: int, info: TensorInfo) -> torch.Tensor:
    """`info.nbytes` bytes at `offset` of the open file `fd`, as a new tensor (read straight into its memory: no
    mapping of the file, so the process holds exactly the tensor). Raises OSError when the file is short."""
    data = torch.empty(info.nbytes, dtype=torch.uint8)
    view = memoryview(data.numpy())
    done = 0
    while done < info.nbytes:  # one read returns at most ~2 GiB on Linux
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"file ends {info.nbytes - done} bytes early")
        done += n
    return data.view(info.dtype).reshape(info.shape)


def tensor_bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a tensor (made contiguous), as they are laid out in memory and in safetensors files."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


class _WeakCache:
    """One weakly held tensor: `get(load)` returns it while anyone holds it, else loads it again."""

    __slots__ = ("_ref",)

    def __init__(self):
        self._ref: weakref.ref | None = None

    def get(self, load: Callable[[], torch.Tensor]) -> torch.Tensor:
        t = self._ref() if self._ref is not None else None
        if t is None:
            t = load()
            self.hold(t)
        return t

    def hold(self, t: torch.Tensor) -> None:
        self._ref = weakref.ref(t)


class SpillFile:
    """An append-only temporary file that holds replaced tensors out of memory.

    `keep(t)` returns `t` itself below `threshold` bytes, else a `Spilled` reference to a copy written here."""

    def __init__(self, threshold: int = SPILL_BYTES, directory: str | os.PathLike | None = None):
        self.threshold = threshold
        self.directory = directory
        self._file = None
        self._end = 0

    def __copy__(self) -> SpillFile:
        return self  # one file, shared by every graph and snapshot made from the same load

    def __deepcopy__(self, memo) -> SpillFile:
        return self

    def keep(self, t: torch.Tensor) -> torch.Tensor | Spilled:
        if not isinstance(t, torch.Tensor) or t.numel() * t.element_size() < self.threshold:
            return t
        if self._file is None:
            self._file = tempfile.TemporaryFile(dir=self.directory)  # noqa: SIM115 - lives as long as the graphs
        data = tensor_bytes_view(t.detach().cpu())
        offset = self._end
        done = 0
        while done < len(data):
            done += os.pwrite(self._file.fileno(), data[done:], offset + done)
        self._end += len(data)
        spilled = Spilled(self, offset, TensorInfo.of(t))
        spilled.cache.hold(t)  # whoever made `t` may still hold it: reading it back can wait until they drop it
        return spilled

    def read(self, offset: int, info: TensorInfo) -> torch.Tensor:
        return read_tensor(self._file.fileno(), offset, info)

    @property
    def spilled_bytes(self) -> int:
        return self._end


class Spilled:
    """A tensor written to a SpillFile: its place and (dtype, shape)."""

    __slots__ = ("cache", "info", "offset", "spill")

    def __init__(self, spill: SpillFile, offset: int, info: TensorInfo):
        self.spill, self.offset, self.info = spill, offset, info
        self.cache = _WeakCache()

    def load(self) -> torch.Tensor:
        return self.cache.get(lambda: self.spill.read(self.offset, self.info))


def _value(entry: torch.Tensor | Spilled) -> torch.Tensor:
    return entry.load() if isinstance(entry, Spilled) else entry


def _info(entry: torch.Tensor | Spilled) -> TensorInfo:
    return entry.info if isinstance(entry, Spilled) else TensorInfo.of(entry)


class IndexedTensors:
    """The name side of a lazy tensor mapping: `_where` (name -> where that tensor is) gives membership, order
    and length; the mapping that mixes this in first reads tensors and their info from it."""

    _where: dict

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


class SpilledTensors(IndexedTensors, Mapping[str, torch.Tensor]):
    """A read-only mapping of tensors some of which live in a SpillFile (e.g. a quantized weight's packed
    tensors), each read back on access."""

    def __init__(self, entries: Mapping[str, torch.Tensor | Spilled]):
        self._where = dict(entries)

    @classmethod
    def keep(cls, tensors: Mapping[str, torch.Tensor], spill: SpillFile) -> Mapping[str, torch.Tensor]:
        """`tensors` with every large one spilled; `tensors` itself when none is large or it already is."""
        if isinstance(tensors, SpilledTensors):
            return tensors
        entries = {k: spill.keep(v) for k, v in tensors.items()}
        if not any(isinstance(e, Spilled) for e in entries.values()):
            return tensors
        return cls(entries)

    def __getitem__(self, name: str) -> torch.Tensor:
        return _value(self._where[name])

    def info(self, name: str) -> TensorInfo:
        return _info(self._where[name])


class TensorStore(MutableMapping[str, torch.Tensor]):
    """The graph's tensors: a read-only base (the checkpoint, read lazily) under an overlay of replaced entries.

    Iteration follows a dict's: base entries in the base's order (a replaced one keeps its place), then new
    ones in insertion order."""

    def __init__(self, base: Mapping[str, torch.Tensor] | None = None,
                 overlay: dict[str, torch.Tensor | Spilled] | None = None, removed: set[str] | None = None,
                 spill: SpillFile | None = None):
        self.base = base if base is not None else {}
        self.overlay = overlay if overlay is not None else {}
        self.removed = removed if removed is not None else set()
        self.spill = spill

    def copy(self) -> TensorStore:
        return TensorStore(self.base, dict(self.overlay), set(self.removed), self.spill)

    def __copy__(self) -> TensorStore:
        return self.copy()

    def _in_base(self, name: str) -> bool:
        return name in self.base and name not in self.removed

    def __contains__(self, name: object) -> bool:
        return name in self.overlay or self._in_base(name)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.overlay:
            return _value(self.overlay[name])
        if self._in_base(name):
            return self.base[name]
        raise KeyError(name)

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self.overlay[name] = self.spill.keep(value) if self.spill is not None else value

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        self.overlay.pop(name, None)
        if name in self.base:
            self.removed.add(name)

    def __iter__(self) -> Iterator[str]:
        yield from (k for k in self.base if k not in self.removed)
        yield from (k for k in self.overlay if k not in self.base or k in self.removed)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def info(self, name: str) -> TensorInfo:
        if name in self.overlay:
            return _info(self.overlay[name])
        if self._in_base(name):
            return tensor_info(self.base, name)
        raise KeyError(name)

    def entry(self, name: str) -> object:
        """What `name` is stored as (compare with `is`): the overlay's entry, the base for an entry never
        replaced, None when absent."""
        if name in self.overlay:
            return self.overlay[name]
        return self.base if self._in_base(name) else None
