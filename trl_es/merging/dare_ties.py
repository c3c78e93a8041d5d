"""Layer-wise DARE-TIES merging of full LoRA deltas, built from ``peft.utils.merge_utils``.

For one module with deltas ``Delta_1..Delta_K``, coefficients ``w_{l,k}`` and density ``d_l`` of its group ``l``:

1. DARE (Yu et al. 2024, "Language Models are Super Mario", Eq. 2): keep each entry with probability ``d_l`` and
   rescale the kept ones by ``1 / d_l`` (``merge_utils.prune(..., method="random", rescale=True)``).
2. TIES (Yadav et al. 2023, "TIES-Merging", Sec. 3, "elect" and "disjoint merge"): elect a sign per entry, then
   ``merged = sum_k w_k Delta'_k m_k / max(1, sum_k m_k)`` over the entries that agree with it.

``sign_election="unweighted"`` is exactly ``merge_utils.dare_ties``; ``"weighted"`` (the default) is mergekit's.
A merge is a deterministic function of ``(deltas, genome, seed)``.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch
from peft.utils.merge_utils import calculate_majority_sign_mask, disjoint_merge, prune, reshape_weight_task_tensors
from torch import nn

from .genome import Genome
from .lora_delta import LoraDeltaSet, target_tensor


SIGN_ELECTIONS = ("weighted", "unweighted")
MAJORITY_SIGN_METHODS = ("total", "frequency")


def module_seed(seed: int, module_name: str) -> int:
    """The DARE seed of one module: a 63-bit hash of ``(seed, module_name)``, the same on every process."""
    # blake2b, not hash(): Python salts str hashes per process, and every rank must draw the same drop mask
    digest = hashlib.blake2b(f"dare\x00{seed}\x00{module_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


@contextlib.contextmanager
def seeded_rng(seed: int | None, device: torch.device):
    """Run the block with the global RNG of ``device`` (and the CPU's) seeded to ``seed`` (``None``: left alone),
    restoring both after."""
    if seed is None:  # the drop mask then follows the caller's global RNG, as in peft
        yield
        return
    # the one CUDA device the tensors live on (the current one for an unindexed "cuda"); none for CPU tensors
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    # peft's prune draws from the global RNG; fork_rng leaves the caller's streams untouched
    with torch.random.fork_rng(devices=devices):
        torch.random.default_generator.manual_seed(seed)
        if devices:
            with torch.cuda.device(devices[0]):
                torch.cuda.manual_seed(seed)  # seeds the current device: made the tensors' one above
        yield


def _check_methods(majority_sign_method: str, sign_election: str) -> None:
    if sign_election not in SIGN_ELECTIONS:
        raise ValueError(f"sign_election must be one of {SIGN_ELECTIONS}, got {sign_election!r}.")
    if majority_sign_method not in MAJORITY_SIGN_METHODS:
        raise ValueError(f"majority_sign_method must be one of {MAJORITY_SIGN_METHODS}, got {majority_sign_method!r}.")


def dare_prune(deltas: torch.Tensor, density: float, seed: int | None = None) -> torch.Tensor:
    """DARE: keep each entry of ``deltas`` (shape ``(K, *weight_shape)``, floating point) with probability
    ``density`` in ``(0, 1]`` and rescale the kept ones by ``1 / density``; same shape and dtype out.
    ``seed`` (see [`module_seed`]) seeds the drop mask, ``None`` uses the global RNG.

    Raises:
        ValueError: for a density outside ``(0, 1]``.
    """
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}.")
    if density >= 1.0:  # nothing dropped, nothing rescaled: the deltas themselves
        return deltas
    with seeded_rng(seed, deltas.device):
        # one prune per delta, in order, as merge_utils.dare_ties: same RNG draws, same masks
        return torch.stack([prune(t, density, method="random", rescale=True) for t in deltas])


def ties_merge(
    pruned: torch.Tensor,
    weights: torch.Tensor | list[float],
    majority_sign_method: str = "total",
    sign_election: str = "weighted",
) -> torch.Tensor:
    """TIES sign election and disjoint merge of K (DARE-pruned) deltas ``pruned``, shape ``(K, *weight_shape)``,
    weighted by ``weights``, shape ``(K,)``: ``sum_k w_k pruned_k m_k / max(1, sum_k m_k)``, shape ``weight_shape``.

    Raises:
        ValueError: for a wrong number of weights or an unknown method.
    """
    _check_methods(majority_sign_method, sign_election)
    weights = torch.as_tensor(weights, dtype=pruned.dtype, device=pruned.device)  # the deltas' dtype and device
    if weights.shape != (pruned.shape[0],):
        raise ValueError(f"weights has shape {tuple(weights.shape)}; expected ({pruned.shape[0]},), one per delta.")
    weighted = pruned * reshape_weight_task_tensors(pruned, weights)  # w_k broadcast over delta k's entries
    # "weighted" votes on w_k Delta'_k (mergekit): a weight-0 adapter takes no part in the vote nor the average, so
    # the search space holds the base model (all 0) and every single adapter; "unweighted" is merge_utils.dare_ties
    vote = weighted if sign_election == "weighted" else pruned
    mask = calculate_majority_sign_mask(vote, method=majority_sign_method)
    # the mean divides by the *number* of agreeing adapters (TIES, peft), not their weights: a small positive weight
    # still dilutes the others, so the merge is not continuous in a weight at 0 (only exactly 0 removes an adapter)
    return disjoint_merge(weighted, mask)


def dare_ties_merge(
    deltas: torch.Tensor,
    weights: torch.Tensor | list[float],
    density: float,
    seed: int | None = None,
    majority_sign_method: str = "total",
    sign_election: str = "weighted",
) -> torch.Tensor:
    """DARE-TIES merge of the K deltas of one module, shape ``(K, *weight_shape)``, with ``weights`` of shape ``(K,)``:
    ``ties_merge(dare_prune(deltas, density, seed), weights)``, shape ``weight_shape``, dtype of ``deltas``.
    ``majority_sign_method``: ``"total"`` (sign of the sum) or ``"frequency"``. Raises ``ValueError`` for a density
    outside ``(0, 1]``, a wrong number of weights, or an unknown method."""
    # checked first, so that a bad method fails before the (costly) drop
    _check_methods(majority_sign_method, sign_election)
    return ties_merge(dare_prune(deltas, density, seed), weights, majority_sign_method, sign_election)


def merge_module_deltas(
    delta_set: LoraDeltaSet,
    genome: Genome,
    module_names: list[str] | None = None,
    device: torch.device | str | None = None,
    cache: dict | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Merge every module's K deltas (built on ``device``) with the genome's coefficients, one module at a time, over
    ``module_names`` (all by default); ``cache``, if given, keeps each module's DARE-pruned deltas.

    Yields:
        `(name, merged)`: ``merged`` is float32 with the shape of the module's weight.
    """
    for name in module_names if module_names is not None else delta_set.module_names:
        weights, density = genome.coefficients(name)
        seed = None if genome.seed is None else module_seed(genome.seed, name)
        # the pruned deltas depend on (density, seed) only, not on the weights; an unseeded drop is never reused
        key = (density, seed)
        if cache is not None and seed is not None and name in cache and cache[name][0] == key:
            pruned = cache[name][1]
        else:
            pruned = dare_prune(delta_set.deltas(name, device), density, seed)
            if cache is not None and seed is not None:
                cache[name] = (key, pruned)
        yield name, ties_merge(pruned, weights, genome.majority_sign_method, genome.sign_election)


class MergeApplier:
    """Writes ``W = W0 + merged delta`` into ``model``'s tensors (in place), from a saved copy of the base tensors
    ``W0``; [`restore`] copies ``W0`` back bitwise. An exception during an ``apply*`` call puts the previous state
    back and re-raises. ``cache_pruned`` keeps every module's DARE-pruned deltas between candidates (``K`` float32
    copies of the targeted weights).

    Raises:
        ValueError: if the adapters target tensors the model does not have, with other shapes, or two delta names
            that are the same tensor in the model (tied weights).
    """

    def __init__(self, model: nn.Module, delta_set: LoraDeltaSet, cache_pruned: bool = False):
        delta_set.check_model(model)
        self.model = model
        self.delta_set = delta_set
        self.weights: dict[str, torch.Tensor] = {name: target_tensor(model, name) for name in delta_set.module_names}
        shared: dict[int, str] = {}  # storage pointer -> delta name: tied weights share one
        for name, w in self.weights.items():
            if w.data_ptr() in shared:
                raise ValueError(f"The deltas {shared[w.data_ptr()]!r} and {name!r} are the same tensor in the model "
                                 "(tied weights): one would overwrite the other.")
            shared[w.data_ptr()] = name
        # W0, the one copy restore() puts back bitwise
        self.base: dict[str, torch.Tensor] = {name: w.detach().clone() for name, w in self.weights.items()}
        self.device = next(iter(self.weights.values())).device
        delta_set.to(self.device)  # the factors live beside the weights they are added to
        # reused while a module's (density, seed) is unchanged: always, with fixed densities and a shared seed; saves
        # the B @ A products and the drop masks of every candidate
        self.cache: dict | None = {} if cache_pruned else None
        self.state: object = "base"  # what the model holds: "base", an adapter index or a Genome (set_state's input)

    @torch.no_grad()
    def apply(self, genome: Genome) -> None:
        """Put the DARE-TIES merge of ``genome`` into the model.

        Raises:
            ValueError: if the genome has no group for some delta (checked before anything is written).
        """
        # checked before any tensor is written: a genome of another delta set leaves the model as it was
        missing = [name for name in self.delta_set.module_names if name not in genome.module_groups]
        if missing:
            raise ValueError(f"The genome has no coefficients for {missing[:4]} ({len(missing)} deltas).")
        self._write_all(merge_module_deltas(self.delta_set, genome, device=self.device, cache=self.cache), genome)

    @torch.no_grad()
    def apply_adapter(self, k: int) -> None:
        """Put adapter ``k`` alone into the model (``W0 + Delta_k``, no drop, no election)."""
        if not 0 <= k < self.delta_set.num_adapters:
            raise ValueError(f"adapter index must be in [0, {self.delta_set.num_adapters}), got {k}.")
        names = self.delta_set.module_names
        # the state recorded is the index k, which set_state re-applies
        self._write_all(((name, self.delta_set.delta(name, k, self.device)) for name in names), k)

    @torch.no_grad()
    def restore(self) -> None:
        """Copy the base tensors back (bitwise) into every tensor the applier writes."""
        for name, weight in self.weights.items():
            weight.copy_(self.base[name])
        self.state = "base"

    def set_state(self, state) -> None:
        """Apply a state as recorded in :attr:`state`: ``"base"``, an adapter index, or a [`Genome`]."""
        if isinstance(state, Genome):
            self.apply(state)
        elif isinstance(state, int):
            self.apply_adapter(state)
        elif state == "base":
            self.restore()
        else:
            raise ValueError(f"Cannot re-apply state {state!r}.")

    @contextlib.contextmanager
    def applied(self, state):
        """Apply ``state`` for the block, then go back to the previous state (also on exceptions)."""
        previous = self.state
        try:
            self.set_state(state)
            yield
        finally:
            self.set_state(previous)

    @torch.no_grad()
    def merged_deltas(self, genome: Genome) -> dict[str, torch.Tensor]:
        """The merged delta of every module (float32, on the model's device), without touching the model."""
        return dict(merge_module_deltas(self.delta_set, genome, device=self.device, cache=self.cache))

    def _write_all(self, items: Iterator[tuple[str, torch.Tensor]], state) -> None:
        """Write every ``(name, delta)``; on any exception put the previous state back (else ``W0``) and re-raise."""
        previous = self.state
        try:
            for name, delta in items:
                self._write(name, delta)
        except BaseException:
            self.restore()  # a half-written model is never left behind: W0 bitwise first
            if previous != "base":
                try:
                    # the previous candidate rebuilt from its genome: bitwise when its merge is deterministic
                    # (seeded, or density 1)
                    self.set_state(previous)
                except BaseException:
                    self.restore()
            raise
        self.state = state  # recorded only once every tensor is written

    def _write(self, name: str, delta: torch.Tensor) -> None:
        weight = self.weights[name]
        # always from W0 (never from the previous candidate), summed in float32 and cast once to the tensor's dtype
        weight.copy_((self.base[name].float() + delta).to(weight.dtype))
