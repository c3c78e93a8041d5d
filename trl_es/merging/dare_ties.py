"""Layer-wise DARE-TIES merging of full LoRA deltas, built from ``peft.utils.merge_utils``.

For one module with deltas ``Delta_1..Delta_K``, coefficients ``w_{l,k}`` and density ``d_l`` of its group ``l``:

1. DARE (Yu et al. 2024, "Language Models are Super Mario", Eq. 2): keep each entry with probability ``d_l`` and
   rescale the kept ones by ``1 / d_l`` (``merge_utils.prune(..., method="random", rescale=True)``).
2. TIES (Yadav et al. 2023, "TIES-Merging", Sec. 3, steps "elect" and "disjoint merge"): elect a sign per entry
   (``merge_utils.calculate_majority_sign_mask``), then average the weighted entries that agree with it
   (``merge_utils.disjoint_merge``): ``merged = sum_k w_k Delta'_k m_k / max(1, sum_k m_k)``.

``sign_election="unweighted"`` elects the sign on the DARE-pruned deltas and weights afterwards: this is exactly
``merge_utils.dare_ties`` (and peft's ``add_weighted_adapter(combination_type="dare_ties_svd")`` before its SVD).
``sign_election="weighted"`` (the default) elects on ``w_k Delta'_k``, as mergekit does: an adapter with weight 0
then takes no part in the vote nor in the average, so the search space contains the base model (all weights 0) and
every single adapter (weight 1 on it, 0 elsewhere, density 1). With equal positive weights both are the same.

The disjoint mean divides by the *number* of agreeing adapters (TIES; peft), not by their weights: a small positive
weight still counts in the denominator and dilutes the others, and only a weight of exactly 0 (with the weighted
election) removes an adapter. The merge is therefore not continuous in a weight at 0; the search copes with it (it
raises the weights it keeps), but a genome with small weights is not "almost" the merge without those adapters.

The DARE drop mask of a module is drawn from the global torch RNG (as peft does) inside ``torch.random.fork_rng``,
seeded from ``(seed, module name)``: a merge is a deterministic function of ``(deltas, genome, seed)``, and the
caller's RNG streams are left untouched.
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
    digest = hashlib.blake2b(f"dare\x00{seed}\x00{module_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


@contextlib.contextmanager
def seeded_rng(seed: int | None, device: torch.device):
    """Run the block with the global RNG of ``device`` (and the CPU's) seeded to ``seed``, restoring both after.

    ``seed=None`` leaves the RNG alone (the drop mask then follows the caller's global RNG, as in peft).
    """
    if seed is None:
        yield
        return
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    with torch.random.fork_rng(devices=devices):
        torch.random.default_generator.manual_seed(seed)
        if devices:
            with torch.cuda.device(devices[0]):
                torch.cuda.manual_seed(seed)
        yield


def _check_methods(majority_sign_method: str, sign_election: str) -> None:
    if sign_election not in SIGN_ELECTIONS:
        raise ValueError(f"sign_election must be one of {SIGN_ELECTIONS}, got {sign_election!r}.")
    if majority_sign_method not in MAJORITY_SIGN_METHODS:
        raise ValueError(f"majority_sign_method must be one of {MAJORITY_SIGN_METHODS}, got {majority_sign_method!r}.")


def dare_prune(deltas: torch.Tensor, density: float, seed: int | None = None) -> torch.Tensor:
    """DARE: keep each entry with probability ``density`` and rescale the kept ones by ``1 / density``.

    Args:
        deltas (`torch.Tensor`): Shape ``(K, *weight_shape)``, floating point.
        density (`float`): Keep probability in ``(0, 1]``; ``1`` returns ``deltas`` unchanged.
        seed (`int`, *optional*): Seed of the drop mask (see [`module_seed`]); ``None`` uses the global RNG.

    Returns:
        `torch.Tensor`: Same shape and dtype as ``deltas``.

    Raises:
        ValueError: for a density outside ``(0, 1]``.
    """
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}.")
    if density >= 1.0:
        return deltas
    with seeded_rng(seed, deltas.device):
        # The loop (one ``prune`` per delta, in order) is merge_utils.dare_ties's: same RNG draws, same masks.
        return torch.stack([prune(t, density, method="random", rescale=True) for t in deltas])


def ties_merge(
    pruned: torch.Tensor,
    weights: torch.Tensor | list[float],
    majority_sign_method: str = "total",
    sign_election: str = "weighted",
) -> torch.Tensor:
    """TIES sign election and disjoint merge of K (DARE-pruned) deltas, weighted by ``weights``.

    Args:
        pruned (`torch.Tensor`): Shape ``(K, *weight_shape)``.
        weights (`torch.Tensor` or `list[float]`): Shape ``(K,)``.
        majority_sign_method (`str`): ``"total"`` or ``"frequency"``.
        sign_election (`str`): ``"weighted"`` or ``"unweighted"`` (see the module docstring).

    Returns:
        `torch.Tensor`: ``sum_k w_k pruned_k m_k / max(1, sum_k m_k)``, shape ``weight_shape``.

    Raises:
        ValueError: for a wrong number of weights or an unknown method.
    """
    _check_methods(majority_sign_method, sign_election)
    weights = torch.as_tensor(weights, dtype=pruned.dtype, device=pruned.device)
    if weights.shape != (pruned.shape[0],):
        raise ValueError(f"weights has shape {tuple(weights.shape)}; expected ({pruned.shape[0]},), one per delta.")
    weighted = pruned * reshape_weight_task_tensors(pruned, weights)
    vote = weighted if sign_election == "weighted" else pruned
    mask = calculate_majority_sign_mask(vote, method=majority_sign_method)
    return disjoint_merge(weighted, mask)


def dare_ties_merge(
    deltas: torch.Tensor,
    weights: torch.Tensor | list[float],
    density: float,
    seed: int | None = None,
    majority_sign_method: str = "total",
    sign_election: str = "weighted",
) -> torch.Tensor:
    """DARE-TIES merge of the K deltas of one module: ``ties_merge(dare_prune(deltas, density, seed), weights)``.

    Args:
        deltas (`torch.Tensor`): Shape ``(K, *weight_shape)``, floating point (float32 recommended).
        weights (`torch.Tensor` or `list[float]`): Shape ``(K,)``, the coefficients ``w_{l,k}``.
        density (`float`): DARE keep probability ``d_l`` in ``(0, 1]``; ``1`` skips the drop (pure TIES without trim).
        seed (`int`, *optional*): Seed of the drop mask (see [`module_seed`]); ``None`` uses the global RNG.
        majority_sign_method (`str`): ``"total"`` (sign of the sum) or ``"frequency"`` (most frequent sign).
        sign_election (`str`): ``"weighted"`` or ``"unweighted"`` (see the module docstring).

    Returns:
        `torch.Tensor`: The merged delta, shape ``weight_shape``, dtype of ``deltas``.

    Raises:
        ValueError: for a density outside ``(0, 1]``, a wrong number of weights, or an unknown method.
    """
    _check_methods(majority_sign_method, sign_election)
    return ties_merge(dare_prune(deltas, density, seed), weights, majority_sign_method, sign_election)


def merge_module_deltas(
    delta_set: LoraDeltaSet,
    genome: Genome,
    module_names: list[str] | None = None,
    device: torch.device | str | None = None,
    cache: dict | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Merge every module's K deltas with the genome's coefficients, one module at a time.

    Args:
        delta_set (`LoraDeltaSet`): The adapters.
        genome (`Genome`): Weights/densities per group, the merge seed and the sign-election settings.
        module_names (`list[str]`, *optional*): A subset of modules; all by default.
        device: Where to build the deltas (the model's device).
        cache (`dict`, *optional*): If given, the DARE-pruned deltas of each module are kept in it, keyed by module
            and reused while ``(density, seed)`` is unchanged (the pruned deltas do not depend on the weights).

    Yields:
        `(name, merged)`: ``merged`` is float32 with the shape of the module's weight.
    """
    for name in module_names if module_names is not None else delta_set.module_names:
        weights, density = genome.coefficients(name)
        seed = None if genome.seed is None else module_seed(genome.seed, name)
        key = (density, seed)
        if cache is not None and seed is not None and name in cache and cache[name][0] == key:
            pruned = cache[name][1]
        else:
            pruned = dare_prune(delta_set.deltas(name, device), density, seed)
            if cache is not None and seed is not None:
                cache[name] = (key, pruned)
        yield name, ties_merge(pruned, weights, genome.majority_sign_method, genome.sign_election)


class MergeApplier:
    """Writes ``W = W0 + merged delta`` into a model's tensors, from a saved copy of the base tensors ``W0``.

    Every ``apply*`` call starts from ``W0`` (never from the previous candidate), computing ``W0 + delta`` in float32
    and casting once to the tensor's dtype; [`restore`] copies ``W0`` back bitwise into every tensor the applier
    writes. An exception during an ``apply*`` call puts the previous state back (``W0`` bitwise, or the previous
    candidate rebuilt from its genome, bitwise when its merge is deterministic: seeded, or density 1) and re-raises.

    Args:
        model (`nn.Module`): The base model; its tensors are changed in place.
        delta_set (`LoraDeltaSet`): The adapters; their factors are moved to the model's device.
        cache_pruned (`bool`): Keep every module's DARE-pruned full deltas between candidates (reused while the
            module's density and seed are unchanged: always, with fixed densities and a shared seed). Saves the
            ``B @ A`` products and the drop masks per candidate at the cost of ``K`` float32 copies of the targeted
            weights in memory.

    Raises:
        ValueError: if the adapters target tensors the model does not have, with other shapes, or two delta names
            that are the same tensor in the model (tied weights).
    """

    def __init__(self, model: nn.Module, delta_set: LoraDeltaSet, cache_pruned: bool = False):
        delta_set.check_model(model)
        self.model = model
        self.delta_set = delta_set
        self.weights: dict[str, torch.Tensor] = {name: target_tensor(model, name) for name in delta_set.module_names}
        shared: dict[int, str] = {}
        for name, w in self.weights.items():
            if w.data_ptr() in shared:
                raise ValueError(f"The deltas {shared[w.data_ptr()]!r} and {name!r} are the same tensor in the model "
                                 "(tied weights): one would overwrite the other.")
            shared[w.data_ptr()] = name
        self.base: dict[str, torch.Tensor] = {name: w.detach().clone() for name, w in self.weights.items()}
        self.device = next(iter(self.weights.values())).device
        delta_set.to(self.device)
        self.cache: dict | None = {} if cache_pruned else None
        self.state: object = "base"

    @torch.no_grad()
    def apply(self, genome: Genome) -> None:
        """Put the DARE-TIES merge of ``genome`` into the model.

        Raises:
            ValueError: if the genome has no group for some delta (checked before anything is written).
        """
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
            self.restore()
            if previous != "base":
                try:
                    self.set_state(previous)
                except BaseException:
                    self.restore()
            raise
        self.state = state

    def _write(self, name: str, delta: torch.Tensor) -> None:
        weight = self.weights[name]
        weight.copy_((self.base[name].float() + delta).to(weight.dtype))
