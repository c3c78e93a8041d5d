"""Seeded, partition-invariant Gaussian noise for ES perturbations.

Element ``j`` of tensor ``name`` for member seed ``s`` depends only on ``(s, name, j)``: tensors are cut into blocks
of ``NOISE_BLOCK_SIZE`` elements, block ``k`` is a float32 N(0, 1) vector keyed by ``(s, name, k)``. Sources:
:class:`NoiseTable` (shared table, Salimans et al. 2017, arXiv 1703.03864, Sec. 2.1), :class:`GaussianNoise`
(fresh CPU draws) and :class:`DeviceGaussianNoise` (fresh draws on the tensor's device).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator

import numpy as np
import torch


NOISE_BLOCK_SIZE = 1 << 20
"""Elements per noise block (fixed: changing it changes every perturbation)."""

DEFAULT_TABLE_SIZE = 1 << 26
"""Default number of fp32 entries of the shared noise table (256 MiB)."""

TABLE_SEED = 1703_03864
"""Seed of the shared noise table (the arXiv id of Salimans et al. 2017)."""

PORTABLE_GENERATOR = "numpy-pcg64"
"""The generator of every new noise source: NumPy's PCG64 and float32 ziggurat, the same values on every CPU."""

LEGACY_GENERATOR = "torch"
"""The generator of version-1 seed logs without a ``"generator"`` in their noise description:
``torch.randn`` on a CPU generator, whose float32 values depend on the CPU's dispatch (AVX2 or not)."""

GENERATORS = (PORTABLE_GENERATOR, LEGACY_GENERATOR)


def standard_normal(length: int, seed: int, generator: str = PORTABLE_GENERATOR) -> torch.Tensor:
    """``length`` i.i.d. N(0, 1) values from ``seed`` in ``[0, 2**63)``: shape ``(length,)``, float32, CPU.

    Raises:
        ValueError: for an unknown ``generator``.
    """
    if generator == PORTABLE_GENERATOR:  # PCG64 + float32 ziggurat: one compiled path, the same on every CPU
        values = np.random.Generator(np.random.PCG64(int(seed))).standard_normal(int(length), dtype=np.float32)
        return torch.from_numpy(values)
    if generator == LEGACY_GENERATOR:  # torch's float32 kernel differs between AVX2 and scalar dispatch
        return torch.randn(int(length), generator=torch.Generator(device="cpu").manual_seed(int(seed)),
                           dtype=torch.float32)
    raise ValueError(f"Unknown noise generator {generator!r}: expected one of {GENERATORS}.")


def block_key(seed: int, name: str, block: int) -> int:
    """Hash ``(seed, name, block)`` (``name`` as in the unwrapped model's ``named_parameters()``) to an ``int`` in
    ``[0, 2**63)``, identically on every process and machine.
    """
    # BLAKE2b, not hash(): Python's hash is salted per process
    digest = hashlib.blake2b(f"{int(seed)}\x00{name}\x00{int(block)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class NoiseSource:
    """Base class of the noise sources: :meth:`block` gives one block, :meth:`pieces` a range of a tensor; a new
    source subclasses it with a :attr:`kind` and registers with :func:`register_noise_source`.
    """

    kind: str = ""  # the ``noise_source`` name, and the ``type`` of its description

    def __init__(self, generator: str = PORTABLE_GENERATOR):
        _check_generator(generator)
        self.generator = generator  # PORTABLE_GENERATOR, or LEGACY_GENERATOR for version-1 seed logs

    @classmethod
    def from_config(cls, noise_table_size: int) -> NoiseSource:
        """The source for ``noise_source=kind`` (:func:`make_noise_source`)."""
        return cls()

    @classmethod
    def from_description(cls, description: dict, generator: str) -> NoiseSource:
        """Inverse of :meth:`describe` (:func:`noise_source_from_description`)."""
        return cls(generator)

    def block(self, seed: int, name: str, index: int, length: int, device: torch.device) -> torch.Tensor:
        """The noise of block ``index`` (``length`` elements) of tensor ``name`` for member ``seed``.

        Returns:
            `torch.Tensor`: Shape ``(length,)``, dtype float32, on ``device``. Treat it as read-only.
        """
        raise NotImplementedError

    def describe(self) -> dict:
        """A JSON-serializable description, written into the seed log so ``replay`` rebuilds the same source."""
        return _with_generator({"type": self.kind, "block_size": NOISE_BLOCK_SIZE}, self.generator)

    @property
    def portable(self) -> bool:
        """Whether runs use the portable arithmetic of :mod:`trl_es.es.perturbation` (all but the legacy one)."""
        return getattr(self, "generator", PORTABLE_GENERATOR) != LEGACY_GENERATOR

    def pieces(
        self, seed: int, name: str, numel: int, start: int = 0, end: int | None = None, device=None
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Yield ``(lo, hi, noise)`` over the local range ``[start, end)`` of a flattened tensor of ``numel``
        elements (the whole tensor's, not the partition's): ``noise`` (float32, ``(hi - lo,)``, on ``device``,
        default CPU) is the noise of ``local_flat[lo:hi]``. Raises ``ValueError`` for a range outside ``[0, numel]``.
        """
        end = numel if end is None else end
        if not 0 <= start <= end <= numel:
            raise ValueError(f"Invalid noise range [{start}, {end}) for a tensor of {numel} elements.")
        device = torch.device("cpu") if device is None else torch.device(device)
        position = start
        while position < end:
            index = position // NOISE_BLOCK_SIZE  # a ZeRO-3 partition generates only the blocks it overlaps
            block_start = index * NOISE_BLOCK_SIZE
            block_length = min(NOISE_BLOCK_SIZE, numel - block_start)  # depends only on the tensor's size
            hi = min(end, block_start + block_length)
            noise = self.block(seed, name, index, block_length, device)
            yield position - start, hi - start, noise[position - block_start : hi - block_start]
            position = hi


@functools.lru_cache(maxsize=2)
def _table_values(size: int, seed: int, device: str, generator: str) -> torch.Tensor:
    return standard_normal(size, seed, generator).to(device)


NOISE_SOURCE_KINDS: dict[str, type[NoiseSource]] = {}
"""The registered noise sources by :attr:`NoiseSource.kind` (:func:`register_noise_source`)."""


def register_noise_source(cls: type[NoiseSource]) -> type[NoiseSource]:
    """Class decorator: make ``cls`` a ``noise_source`` choice and replayable from its description.

    Raises:
        ValueError: for an empty ``kind``, ``"auto"``, or a kind another class holds.
    """
    if not cls.kind or cls.kind == "auto" or NOISE_SOURCE_KINDS.get(cls.kind, cls) is not cls:
        raise ValueError(f"A noise source needs its own kind (not empty, not 'auto'), got {cls.kind!r} for "
                         f"{cls.__name__} (registered: {tuple(NOISE_SOURCE_KINDS)}).")
    NOISE_SOURCE_KINDS[cls.kind] = cls
    return cls


@register_noise_source
class NoiseTable(NoiseSource):
    """A shared table of N(0, 1) values; a block is a contiguous slice at a hashed offset (Salimans et al. 2017).

    Raises:
        ValueError: if ``size < NOISE_BLOCK_SIZE`` or ``generator`` is unknown.
    """

    kind = "table"

    def __init__(self, size: int = DEFAULT_TABLE_SIZE, seed: int = TABLE_SEED, generator: str = PORTABLE_GENERATOR):
        if size < NOISE_BLOCK_SIZE:
            raise ValueError(f"noise_table_size must be 0 (no table) or >= {NOISE_BLOCK_SIZE}, got {size}.")
        super().__init__(generator)
        self.size = int(size)  # fp32 entries; default 2**26 (256 MiB)
        self.seed = int(seed)  # the table is generated on CPU by `generator` (standard_normal)

    @classmethod
    def from_config(cls, noise_table_size):
        return cls(noise_table_size) if noise_table_size else GaussianNoise()  # 0: no table, fresh blocks

    @classmethod
    def from_description(cls, description, generator):
        return cls(description["size"], description["seed"], generator)

    def values(self, device) -> torch.Tensor:
        """The whole table, shape ``(size,)``, float32, on ``device`` (built once per device and cached)."""
        return _table_values(self.size, self.seed, str(torch.device(device)), self.generator)

    def block(self, seed, name, index, length, device):
        offset = block_key(seed, name, index) % (self.size - length + 1)  # a block never runs past the end
        return self.values(device)[offset : offset + length]

    def describe(self) -> dict:
        return _with_generator({"type": "table", "size": self.size, "seed": self.seed, "block_size": NOISE_BLOCK_SIZE},
                               self.generator)


@register_noise_source
class GaussianNoise(NoiseSource):
    """Fresh Gaussian noise per block, generated on CPU from ``block_key`` (:func:`standard_normal`).

    Args:
        generator (`str`): :data:`PORTABLE_GENERATOR` (default) or :data:`LEGACY_GENERATOR`.
    """

    kind = "gaussian"  # fresh CPU draws per block; the name stays: seed logs record it and must replay

    def block(self, seed, name, index, length, device):
        return standard_normal(length, block_key(seed, name, index), self.generator).to(device)


@register_noise_source
class DeviceGaussianNoise(NoiseSource):
    """Fresh Gaussian noise per block from a ``torch.Generator`` on the tensor's device, seeded with ``block_key``.

    Values depend on the device type (replay on the same kind); on CPU they equal :class:`GaussianNoise`.
    """

    kind = "device_gaussian"

    def block(self, seed, name, index, length, device):
        device = torch.device(device)
        if device.type == "cpu":  # the portable CPU draw, as GaussianNoise
            return standard_normal(length, block_key(seed, name, index), self.generator)
        # CUDA: counter-based Philox, one kernel per block, no host transfer, no table in device memory
        generator = torch.Generator(device=device).manual_seed(block_key(seed, name, index))
        return torch.randn(length, generator=generator, dtype=torch.float32, device=device)


def _check_generator(generator: str) -> None:
    if generator not in GENERATORS:
        raise ValueError(f"Unknown noise generator {generator!r}: expected one of {GENERATORS}.")


def _with_generator(description: dict, generator: str) -> dict:
    # A legacy source keeps the legacy description (no "generator"), so old seed logs and checkpoints compare equal.
    return description if generator == LEGACY_GENERATOR else {**description, "generator": generator}


NOISE_SOURCES = ("auto", *NOISE_SOURCE_KINDS)
"""The ``noise_source`` choices of the built-in sources (``ESConfig.noise_source``)."""


def make_noise_source(noise_table_size: int = DEFAULT_TABLE_SIZE, kind: str = "table", device=None,
                      lowrank: bool = False, lean_memory: bool = False) -> NoiseSource:
    """Build a registered ``kind`` (:data:`NOISE_SOURCE_KINDS`) or pick one for ``"auto"`` from ``device``,
    ``lowrank`` and ``lean_memory`` (see ``benchmarks/noise_sources.py``).

    Raises:
        ValueError: for an unknown ``kind`` or a ``noise_table_size`` neither 0 nor ``>= NOISE_BLOCK_SIZE``.
    """
    if kind != "auto" and kind not in NOISE_SOURCE_KINDS:
        raise ValueError(f"noise_source must be one of {('auto', *NOISE_SOURCE_KINDS)}, got {kind!r}.")
    if noise_table_size < 0 or 0 < noise_table_size < NOISE_BLOCK_SIZE:
        raise ValueError(f"noise_table_size must be 0 (fresh Gaussian blocks) or >= {NOISE_BLOCK_SIZE}, "
                         f"got {noise_table_size}.")
    if kind == "auto":
        cuda = device is not None and torch.device(device).type == "cuda"
        if lean_memory:  # no table: fresh blocks (the device generator on CUDA)
            kind = "device_gaussian" if cuda else "gaussian"
        elif noise_table_size == 0 or lowrank:  # low-rank: a few thousand values per member and weight
            kind = "gaussian"
        else:
            kind = "device_gaussian" if cuda else "table"  # the table: ~10x faster than fresh draws on CPU
    return NOISE_SOURCE_KINDS[kind].from_config(noise_table_size)


def noise_source_from_description(description: dict) -> NoiseSource:
    """Inverse of :meth:`NoiseSource.describe` (used by ``replay``).

    Raises:
        ValueError: for another block size, an unknown type or generator.
    """
    if description.get("block_size", NOISE_BLOCK_SIZE) != NOISE_BLOCK_SIZE:
        raise ValueError(f"This log was written with noise block size {description['block_size']}.")
    kind = NOISE_SOURCE_KINDS.get(description["type"])
    if kind is None:
        raise ValueError(f"Unknown noise source type {description['type']!r}: expected one of "
                         f"{tuple(NOISE_SOURCE_KINDS)}.")
    # no "generator": a version-1 seed log, replayed with the torch generator it was trained with
    return kind.from_description(description, description.get("generator", LEGACY_GENERATOR))


def full_noise(source: NoiseSource, seed: int, name: str, shape, device=None) -> torch.Tensor:
    """The whole noise tensor of one parameter (for tests and analysis; training never materializes it).

    Returns:
        `torch.Tensor`: float32 tensor of ``shape``.
    """
    numel = 1
    for dim in shape:
        numel *= int(dim)
    out = torch.empty(numel, dtype=torch.float32, device=device)
    for lo, hi, noise in source.pieces(seed, name, numel, device=device):
        out[lo:hi] = noise
    return out.view(*shape)
