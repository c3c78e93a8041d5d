"""The anchor theta_0: the trained parameters' initial values, for Anchored Weight Decay and drift logging.

A read-only mapping ``name -> tensor`` (the local partition, the parameter's dtype, CPU): :class:`MemoryAnchor`
holds copies, :class:`FileAnchor` reads one tensor at a time from safetensors files that hold exactly these values.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Iterator, Mapping

import torch
from safetensors import safe_open

from .perturbation import TrainedParameters


ANCHOR_STORAGES = ("auto", "memory", "file")

logger = logging.getLogger(__name__)


class MemoryAnchor(Mapping):
    """theta_0 as resident CPU copies of ``tensors`` in the parameters' dtype."""

    storage = "memory"

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        # theta_0 is the initial parameter: its own dtype is exact (an fp32 copy of bf16 would double the bytes)
        self._tensors = {n: t.detach().to("cpu", copy=True) for n, t in tensors.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())


class FileAnchor(Mapping):
    """theta_0 read on demand from safetensors files: ``sources`` maps a name to ``(path, key, start, length)``,
    elements ``[start, start + length)`` of the flattened ``key``; ``fallback`` holds the others in memory.
    """

    storage = "file"

    def __init__(self, sources: dict, fallback: Mapping | None = None, shapes: dict | None = None,
                 dtypes: dict | None = None):
        self.sources = dict(sources)
        self.fallback = MemoryAnchor(fallback or {})
        self.shapes = dict(shapes or {})
        self.dtypes = dict(dtypes or {})
        self._stamps = {path: _stamp(path) for path, *_ in self.sources.values()}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.fallback:
            return self.fallback[name]
        path, key, start, length = self.sources[name]
        if _stamp(path) != self._stamps[path]:  # rewritten or replaced since the anchor was built
            raise ValueError(f"theta_0 is read from {path}, which changed after training started (it was "
                             "overwritten?): the anchor is lost. Keep the base checkpoint unchanged, or use "
                             "anchor_storage='memory'.")
        with safe_open(path, framework="pt", device="cpu") as f:  # nothing stays resident: map, copy, unmap
            flat = f.get_slice(key)[:] if length is None else _read_flat_range(f, key, start, length)
        flat = flat.reshape(-1)
        flat = flat.to(self.dtypes[name]) if name in self.dtypes and flat.dtype != self.dtypes[name] else flat.clone()
        return flat.view(self.shapes[name]) if name in self.shapes else flat

    def __iter__(self) -> Iterator[str]:
        yield from self.sources
        yield from (n for n in self.fallback if n not in self.sources)

    def __len__(self) -> int:
        return len(set(self.sources) | set(self.fallback))

    @property
    def resident_bytes(self) -> int:
        return self.fallback.resident_bytes

    @property
    def folders(self) -> set[str]:
        """The folders of the files theta_0 is read from."""
        return {os.path.dirname(os.path.abspath(path)) for path, *_ in self.sources.values()}

    def materialize(self) -> MemoryAnchor:
        """A :class:`MemoryAnchor` with the same values (read now, one tensor at a time)."""
        return MemoryAnchor({name: self[name] for name in self})


def _stamp(path: str) -> tuple[int, int, int]:
    """``(inode, size, mtime_ns)`` of a file: changes when the file is rewritten or replaced."""
    stat = os.stat(path)
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _read_flat_range(handle, key: str, start: int, length: int) -> torch.Tensor:
    """Elements ``[start, start + length)`` of the flattened tensor ``key`` (only the rows they span are read)."""
    view = handle.get_slice(key)
    shape = view.get_shape()
    if not shape:
        return view[:].reshape(-1)[start : start + length]
    row = 1
    for dim in shape[1:]:
        row *= int(dim)
    first, last = start // row, -(-(start + length) // row)  # only the rows the range spans are read
    rows = view[first:last].reshape(-1)
    offset = start - first * row
    return rows[offset : offset + length]


def checkpoint_weight_map(folder: str) -> dict[str, str]:
    """``tensor name -> safetensors path`` of a ``save_pretrained`` folder (``model.safetensors`` or the shards of
    ``model.safetensors.index.json``); ``{}`` if it holds neither.
    """
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        with safe_open(single, framework="pt", device="cpu") as f:
            return dict.fromkeys(f.keys(), single)
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {name: os.path.join(folder, file) for name, file in json.load(f)["weight_map"].items()}
    return {}


def checkpoint_files(model) -> list[str]:
    """The safetensors files of ``model``'s checkpoint folder (``model.name_or_path``) that exist, or ``[]``
    (:func:`checkpoint_weight_map`)."""
    folder = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not folder or not os.path.isdir(folder):
        return []
    return sorted(f for f in set(checkpoint_weight_map(folder).values()) if os.path.isfile(f))


def make_anchor(params: TrainedParameters, storage: str = "auto", files: list[str] | None = None,
                lean_memory: bool = False, required: bool = True):
    """The anchor theta_0 of ``params`` as they are now: ``"memory"`` copies, or ``"file"`` / ``"auto"`` reading from
    ``files`` every tensor stored there bitwise (copies for the others); ``None`` only under ``lean_memory`` when not
    ``required``.

    Raises:
        ValueError: for an unknown ``storage``.
    """
    if storage not in ANCHOR_STORAGES:
        raise ValueError(f"anchor_storage must be one of {ANCHOR_STORAGES}, got {storage!r}.")
    if lean_memory:  # "auto" is "file"; resident tensors are kept only for AWD
        return _lean(make_anchor(params, "file" if storage == "auto" else storage, files), required)
    values = {e.name: e for e in params.entries}
    if storage == "memory" or not files:  # "file" and "auto" behave alike; "file" states the intent
        return MemoryAnchor({n: e.param for n, e in values.items()})
    where = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                where.setdefault(key, path)
    sources, fallback, shapes, dtypes = {}, {}, {}, {}
    for name, e in values.items():
        path = where.get(name)
        local = e.param.numel()
        same = False
        if path is not None:
            with safe_open(path, framework="pt", device="cpu") as f:
                numel = 1
                for dim in f.get_slice(name).get_shape():
                    numel *= int(dim)
                # another float dtype counts when its values cast to the parameter's are the parameter
                if numel == e.numel and f.get_slice(name).get_dtype() in _FLOAT_DTYPES:
                    stored = _read_flat_range(f, name, e.start, local).to(e.param.dtype)
                    same = torch.equal(stored, e.param.detach().reshape(-1).cpu())
        if same:  # checked now, one tensor at a time; otherwise a resident copy
            sources[name] = (path, name, e.start, local)
            shapes[name], dtypes[name] = e.param.shape, e.param.dtype
        else:
            fallback[name] = e.param
    if not sources:
        return MemoryAnchor(fallback)
    return FileAnchor(sources, fallback, shapes, dtypes)


def _lean(anchor, required: bool):
    """lean_memory's rule: an anchor with resident tensors is kept for AWD (warned), dropped for drift logging."""
    if not anchor.resident_bytes:  # all in files: nothing resident to weigh
        return anchor
    if required:  # AWD cannot run without theta_0
        warnings.warn(f"lean_memory: the base checkpoint file does not hold theta_0 of every trained tensor; AWD "
                      f"keeps {anchor.resident_bytes / 2**20:.1f} MiB of it in memory.", stacklevel=4)
        return anchor
    logger.info("lean_memory: theta_0 is not in a checkpoint file; drift logging is skipped.")
    return None


_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
