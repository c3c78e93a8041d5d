"""The Hyper-ES genome: merge coefficients per group of modules, and the box CMA-ES searches them in.

A *group* shares coefficients: the whole model (``"global"``), one transformer block (``"layer"``, the layer-wise
merges of Akiba et al. 2024, "Evolutionary Optimization of Model Merging Recipes", Sec. 3.1) or one module
(``"module"``); CMA-ES searches a vector in the unit box ``[0, 1]^n``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..files import write_json


GRANULARITIES = ("global", "layer", "module")
_LAYER_RE = re.compile(r"\.(\d+)(?:\.|$)")  # the first integer path component: ".3." or a trailing ".3"


def layer_index(module_name: str) -> int | None:
    """The transformer block of a module: the first integer path component (``model.layers.3.mlp.up_proj`` -> 3)."""
    match = _LAYER_RE.search(module_name)
    return int(match.group(1)) if match else None


def group_modules(module_names: Sequence[str], granularity: str) -> tuple[list[str], dict[str, int]]:
    """Assign modules (relative to the base model) to coefficient groups by ``granularity`` (one of
    ``GRANULARITIES``): ``(group_names, module_groups)``, group names in order (``layer.0, layer.1, ...``) and module ->
    group index. Raises ``ValueError`` for an unknown granularity."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"genome_granularity must be one of {GRANULARITIES}, got {granularity!r}.")
    if granularity == "global":  # one weight per adapter for the whole model
        return ["all"], dict.fromkeys(module_names, 0)
    if granularity == "module":  # every module its own group, in the order given
        return list(module_names), {name: i for i, name in enumerate(module_names)}
    layers = sorted({i for i in map(layer_index, module_names) if i is not None})
    names = [f"layer.{i}" for i in layers]
    if any(layer_index(n) is None for n in module_names):
        names.append("other")  # every module outside the numbered blocks (e.g. lm_head) shares this one group
    position = {name: i for i, name in enumerate(names)}  # group index: blocks in numeric order, "other" last
    groups = {n: position[f"layer.{layer_index(n)}" if layer_index(n) is not None else "other"] for n in module_names}
    return names, groups


@dataclass
class Genome:
    """Decoded merge coefficients: everything needed to rebuild one DARE-TIES merge.

    Attributes:
        weights (`np.ndarray`): Shape ``(G, K)``, float64: weight of adapter ``k`` in group ``g``.
        densities (`np.ndarray`): Shape ``(G,)``, float64: DARE keep probability per group.
        group_names (`list[str]`): ``G`` names.
        module_groups (`dict[str, int]`): Module name -> group index.
        adapter_names (`list[str]`): ``K`` names.
        granularity (`str`): How modules were grouped.
        seed (`int` or `None`): Seed of the DARE drop masks (see ``dare_ties.module_seed``).
        sign_election (`str`): ``"weighted"`` or ``"unweighted"``.
        majority_sign_method (`str`): ``"total"`` or ``"frequency"``.
    """

    weights: np.ndarray
    densities: np.ndarray
    group_names: list[str]
    module_groups: dict[str, int]
    adapter_names: list[str]
    granularity: str = "layer"
    seed: int | None = 0
    sign_election: str = "weighted"
    majority_sign_method: str = "total"
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        # float64 whatever came in (lists from JSON, CMA-ES's arrays): a genome saved and loaded is the same genome
        self.weights = np.asarray(self.weights, dtype=np.float64)
        self.densities = np.asarray(self.densities, dtype=np.float64)
        g, k = len(self.group_names), len(self.adapter_names)
        if self.weights.shape != (g, k):
            raise ValueError(f"weights has shape {self.weights.shape}; expected (groups, adapters) = ({g}, {k}).")
        if self.densities.shape != (g,):
            raise ValueError(f"densities has shape {self.densities.shape}; expected ({g},).")

    def coefficients(self, module_name: str) -> tuple[list[float], float]:
        """``(weights over the K adapters, density)`` of the module's group."""
        g = self.module_groups[module_name]
        # plain Python floats: the merge builds its tensors in the deltas' dtype and device
        return self.weights[g].tolist(), float(self.densities[g])

    def to_dict(self) -> dict:
        """A JSON-serializable dict (plain lists and numbers)."""
        return {
            "granularity": self.granularity,
            "adapter_names": list(self.adapter_names),
            "group_names": list(self.group_names),
            "weights": self.weights.tolist(),
            "densities": self.densities.tolist(),
            "seed": self.seed,
            "sign_election": self.sign_election,
            "majority_sign_method": self.majority_sign_method,
            "module_groups": dict(self.module_groups),
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Genome:
        """Inverse of [`to_dict`]."""
        return cls(
            weights=np.asarray(data["weights"], dtype=np.float64),
            densities=np.asarray(data["densities"], dtype=np.float64),
            group_names=list(data["group_names"]),
            module_groups={k: int(v) for k, v in data["module_groups"].items()},
            adapter_names=list(data["adapter_names"]),
            # the .get defaults are the field defaults, for files that left a field out
            granularity=data.get("granularity", "layer"),
            seed=data.get("seed"),
            sign_election=data.get("sign_election", "weighted"),
            majority_sign_method=data.get("majority_sign_method", "total"),
            metadata=dict(data.get("metadata", {})),
        )

    def save_json(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_dict` as JSON, atomically (the caller picks the one process that writes)."""
        write_json(path, self.to_dict())

    @classmethod
    def load_json(cls, path: str | os.PathLike) -> Genome:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def summary(self) -> dict[str, float]:
        """Mean weight per adapter and mean density: a compact line for logs."""
        out = {f"weight/{name}": float(self.weights[:, k].mean()) for k, name in enumerate(self.adapter_names)}
        out["density"] = float(self.densities.mean())
        return out


@dataclass
class GenomeSpace:
    """The search box and its map from CMA-ES's unit-box vector to a [`Genome`].

    The vector is ``[w_{0,0..K-1}, w_{1,0..K-1}, ..., w_{G-1,..}, d_0, ..., d_{G-1}]`` (densities only with
    ``search_density=True``), every entry in ``[0, 1]``; entry ``x`` maps to ``lo + (hi - lo) * x`` of
    ``weight_bounds`` / ``density_bounds`` (within ``(0, 1]``). ``density`` is the fixed density, or the initial one.

    Raises:
        ValueError: for empty or inverted bounds, or a density outside its bounds/``(0, 1]``.
    """

    group_names: list[str]
    module_groups: dict[str, int]
    adapter_names: list[str]
    granularity: str = "layer"
    weight_bounds: tuple[float, float] = (0.0, 2.0)
    density_bounds: tuple[float, float] = (0.1, 1.0)
    search_density: bool = False
    density: float = 0.5
    seed: int | None = 0
    sign_election: str = "weighted"
    majority_sign_method: str = "total"

    def __post_init__(self):
        self.weight_bounds = tuple(float(b) for b in self.weight_bounds)
        self.density_bounds = tuple(float(b) for b in self.density_bounds)
        lo, hi = self.weight_bounds
        if not lo < hi:
            raise ValueError(f"weight_bounds must be (lo, hi) with lo < hi, got {self.weight_bounds}.")
        dlo, dhi = self.density_bounds
        if not 0.0 < dlo < dhi <= 1.0:
            raise ValueError(f"density_bounds must be (lo, hi) with 0 < lo < hi <= 1, got {self.density_bounds}.")
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density}.")
        if self.search_density and not dlo <= self.density <= dhi:
            raise ValueError(
                f"density {self.density} (the initial density) must lie within density_bounds {self.density_bounds}."
            )

    @classmethod
    def from_modules(
        cls, module_names: Sequence[str], adapter_names: Sequence[str], granularity: str = "layer", **kwargs
    ) -> GenomeSpace:
        """Group ``module_names`` by ``granularity`` and build the space (``kwargs``: the other fields)."""
        group_names, module_groups = group_modules(module_names, granularity)
        return cls(group_names, module_groups, list(adapter_names), granularity, **kwargs)

    @property
    def num_groups(self) -> int:
        return len(self.group_names)

    @property
    def num_adapters(self) -> int:
        return len(self.adapter_names)

    @property
    def dim(self) -> int:
        """Length of the search vector."""
        return self.num_groups * self.num_adapters + (self.num_groups if self.search_density else 0)

    def _unit(self, value: np.ndarray, bounds: tuple[float, float]) -> np.ndarray:
        # inverse of decode's affine map: the bound's box back to [0, 1]
        lo, hi = bounds
        return (np.asarray(value, dtype=np.float64) - lo) / (hi - lo)

    def decode(self, x: Sequence[float]) -> Genome:
        """Map a unit-box vector to a genome (entries are clipped to ``[0, 1]`` first).

        Raises:
            ValueError: if ``len(x) != dim``.
        """
        # pycma's bounds=[0, 1] keeps its samples inside; the clip guards any other caller
        x = np.clip(np.asarray(x, dtype=np.float64), 0.0, 1.0)
        if x.shape != (self.dim,):
            raise ValueError(f"Genome vector has shape {x.shape}; expected ({self.dim},).")
        g, k = self.num_groups, self.num_adapters
        lo, hi = self.weight_bounds
        # affine onto each bound's box: one sigma0 is "a fraction of the width" for weights and densities alike
        weights = lo + (hi - lo) * x[: g * k].reshape(g, k)
        if self.search_density:
            dlo, dhi = self.density_bounds
            densities = dlo + (dhi - dlo) * x[g * k :]
        else:
            densities = np.full(g, self.density)  # not searched: the fixed density in every group
        return self._genome(weights, densities)

    def encode(self, genome: Genome) -> np.ndarray:
        """Inverse of [`decode`] for a genome of this space (the densities are dropped when not searched)."""
        parts = [self._unit(genome.weights, self.weight_bounds).reshape(-1)]  # row-major: group by group
        if self.search_density:
            parts.append(self._unit(genome.densities, self.density_bounds))
        return np.concatenate(parts)

    def uniform(self, weight: float = 1.0, density: float | None = None) -> Genome:
        """All weights equal to ``weight``, every density ``density`` (the space's ``density`` by default)."""
        d = self.density if density is None else density
        return self._genome(np.full((self.num_groups, self.num_adapters), float(weight)), np.full(self.num_groups, d))

    def single(self, k: int, weight: float = 1.0, density: float = 1.0) -> Genome:
        """Weight ``weight`` on adapter ``k`` and 0 elsewhere."""
        # with sign_election="weighted" the zero weights drop out of the vote: adapter k alone
        weights = np.zeros((self.num_groups, self.num_adapters))
        weights[:, k] = weight
        return self._genome(weights, np.full(self.num_groups, float(density)))

    def x0(self, weight: float = 1.0) -> np.ndarray:
        """CMA-ES's initial mean: the uniform merge (all weights ``weight``, densities at ``density``).

        Raises:
            ValueError: if ``weight`` is outside ``weight_bounds``.
        """
        lo, hi = self.weight_bounds
        if not lo <= weight <= hi:
            raise ValueError(f"initial_weight {weight} must lie within weight_bounds {self.weight_bounds}.")
        return self.encode(self.uniform(weight))

    def _genome(self, weights: np.ndarray, densities: np.ndarray) -> Genome:
        return Genome(
            weights=weights,
            densities=densities,
            group_names=list(self.group_names),
            module_groups=dict(self.module_groups),
            adapter_names=list(self.adapter_names),
            granularity=self.granularity,
            seed=self.seed,
            sign_election=self.sign_election,
            majority_sign_method=self.majority_sign_method,
        )
