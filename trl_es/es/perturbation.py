"""What a perturbation ``eps_i`` is: full-rank Gaussian noise, or a rank-``r`` product (EGGROLL).

A :class:`Perturbation` knows two things about the noise ``eps_i`` of a member:

- how to put it into a model: :class:`GaussianPerturbation` writes ``theta + sign * sigma * eps`` into the weights
  in place (:meth:`GaussianPerturbation.perturb_`; the master copy restores them bitwise); :class:`LowRankPerturbation`
  never writes the weights: :class:`LowRankAdapters` adds ``(sign sigma / sqrt(r)) (x B_i) A_i^T`` to the rows of
  member ``i`` inside each targeted ``nn.Linear``, many members in one batch, as multi-LoRA serving does;
- the *direction* of an update, ``sum_i c_i sign_i eps_i`` in fp32 (:meth:`Perturbation.direction_sums`), summed in
  a fixed order so that every process and :func:`trl_es.replay` obtain bitwise identical results.

The ES step itself (one function for every perturbation) lives in :mod:`trl_es.es.update`.

Low-rank noise (Sarkar et al. 2025, "Evolution Strategies at the Hyperscale", EGGROLL, arXiv 2511.16652): member
``i`` perturbs every targeted weight ``W`` (``out x in``) by

    E_i = sign_i * (sigma / sqrt(r)) * A_i @ B_i^T,      A_i: (out, r),  B_i: (in, r),  entries i.i.d. N(0, 1),

so each element of ``A_i B_i^T / sqrt(r)`` has unit variance, as the full-rank noise has. ``A_i`` and ``B_i`` come
from the seeded, partition-invariant noise source (:mod:`trl_es.es.noise`) under the tensor names
``name + ".lowrank_A"`` and ``name + ".lowrank_B"`` (row-major ``(out, r)`` and ``(in, r)``).
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from .arithmetic import add_scaled_, added_scaled
from .noise import NOISE_BLOCK_SIZE, NoiseSource, full_noise
from .update import Member, TrainedParameters, _Entry


LOWRANK_A_SUFFIX = ".lowrank_A"
LOWRANK_B_SUFFIX = ".lowrank_B"

SELECT_HINT = (
    "The low-rank perturbation (population_backend='batched_lowrank') perturbs and trains only the 2-D weights of "
    "nn.Linear modules; by default it selects every nn.Linear weight that is not tied to another module. Narrow the "
    "selection with include_parameters / exclude_parameters, e.g. include_parameters=r'proj\\.weight$' for "
    "Llama/Qwen/SmolLM attention and MLP projections (norms, biases, embeddings and an lm_head tied to the "
    "embeddings are not supported)."
)


class Perturbation(ABC):
    """What the noise ``eps_i`` of a member is, and the direction sum of an update along it.

    ``describe()`` is written into the seed log so that :func:`trl_es.replay` rebuilds the same perturbation.
    """

    name = "perturbation"

    def describe(self) -> dict:
        """JSON-serializable facts needed to rebuild this perturbation (seed-log header ``"perturbation"``)."""
        return {"type": self.name}

    def check(self, params: TrainedParameters) -> None:  # noqa: B027 (optional hook: accepts all by default)
        """Raise ``ValueError`` if ``params`` holds a tensor this perturbation cannot perturb (before any work)."""

    @abstractmethod
    def direction_sums(
        self, params: TrainedParameters, noise: NoiseSource, members: Sequence[Member], coefficients: Sequence[float]
    ) -> Iterator[tuple[_Entry, int, int, torch.Tensor]]:
        """Yield ``(entry, lo, hi, s)``: ``s = sum_i coefficients[i] * sign_i * eps_i`` over the local flat elements
        ``[lo, hi)`` of ``entry`` (float32, shape ``(hi - lo,)``), covering every local element of every entry once.

        Members with a zero coefficient are skipped. The sum is formed in a fixed order (members in population
        order), so every process and ``replay`` obtain bitwise identical results.
        """


class GaussianPerturbation(Perturbation):
    """Full-rank Gaussian noise: ``eps_i`` has one i.i.d. N(0, 1) entry per trained element (Qiu et al. 2025,
    arXiv 2509.24372, Algorithm 1), put into the model in place and restored bitwise from the master copy
    (:meth:`TrainedParameters.write_master_to_model_`).

    Works on any floating-point tensor and on partitions (DeepSpeed ZeRO-3): noise is generated only for the locally
    held elements.
    """

    name = "gaussian"

    def perturb_(self, params: TrainedParameters, noise: NoiseSource, member: Member, sigma: float) -> None:
        """Write ``cast(master + sign * sigma * eps)`` into the model, in fp32, block by block.

        Args:
            params (`TrainedParameters`): The trained parameters and their master copy.
            noise (`NoiseSource`): The noise source.
            member (`Member`): The member (seed and sign).
            sigma (`float`): The noise scale.

        Raises:
            ValueError: if a master aliases its parameter (a perturbation in place would destroy the weights).
        """
        if any(e.master_is_param for e in params.entries):
            raise ValueError("In-place perturbation needs a master copy distinct from the model's weights.")
        with torch.no_grad():
            for e in params.entries:
                _write_perturbed(e.param.view(-1), e.master.view(-1), noise, member, sigma, e.name, e.numel, e.start)
        params.perturbed = True

    @staticmethod
    @torch.no_grad()
    def perturbed_tensor(master: torch.Tensor, noise: NoiseSource, member: Member, sigma: float, name: str,
                         dtype: torch.dtype) -> torch.Tensor:
        """``cast(master + sign * sigma * eps)`` of one whole tensor: bitwise what :meth:`perturb_` writes into a
        parameter of dtype ``dtype`` whose master is ``master`` (for an engine that loads member weights itself,
        e.g. the vLLM worker, :mod:`trl_es.generation.vllm_worker`).

        Args:
            master (`torch.Tensor`): The whole master tensor (any shape; fp32 or the parameter's dtype).
            noise (`NoiseSource`), member (`Member`), sigma (`float`): As in :meth:`perturb_`.
            name (`str`): The parameter name (keys the noise).
            dtype (`torch.dtype`): The parameter's dtype.

        Returns:
            `torch.Tensor`: A new tensor of ``master``'s shape, dtype ``dtype``, on ``master``'s device.
        """
        out = torch.empty(master.shape, dtype=dtype, device=master.device)
        _write_perturbed(out.view(-1), master.reshape(-1), noise, member, sigma, name, master.numel(), 0)
        return out

    def direction_sums(self, params, noise, members, coefficients):
        pairs = [(m, float(c) * m.sign) for m, c in zip(members, coefficients, strict=True) if float(c) != 0.0]
        for e in params.entries:
            local = e.param.numel()
            device = e.master.device
            position = 0
            while position < local:
                hi = min(local, position + _block_span(e.start + position))
                total = torch.zeros(hi - position, dtype=torch.float32, device=device)
                for member, coef in pairs:
                    for lo2, hi2, eps in noise.pieces(member.seed, e.name, e.numel, e.start + position,
                                                      e.start + hi, device=device):
                        add_scaled_(total[lo2:hi2], eps, coef, noise.portable)
                yield e, position, hi, total
                position = hi


def _write_perturbed(flat_param: torch.Tensor, flat_master: torch.Tensor, noise: NoiseSource, member: Member,
                     sigma: float, name: str, numel: int, start: int) -> None:
    """``flat_param <- cast(flat_master + sign * sigma * eps)`` over the local elements ``[start, start + len)`` of
    tensor ``name`` (``numel`` elements in all), computed in fp32 block by block."""
    scale = float(member.sign) * float(sigma)
    pieces = noise.pieces(member.seed, name, numel, start, start + flat_param.numel(), device=flat_param.device)
    for lo, hi, eps in pieces:
        if flat_param.dtype == torch.float32 and flat_master.dtype == torch.float32:
            added_scaled(flat_master[lo:hi], eps, scale, noise.portable, out=flat_param[lo:hi])
        else:
            flat_param[lo:hi].copy_(added_scaled(flat_master[lo:hi].float(), eps, scale, noise.portable))


def _block_span(position: int) -> int:
    """Elements from ``position`` to the end of its noise block (sums are formed per noise block)."""
    return NOISE_BLOCK_SIZE - position % NOISE_BLOCK_SIZE


# ---------------------------------------------------------------------------------------------- low rank
def lowrank_factors(
    noise: NoiseSource, seed: int, name: str, out_features: int, in_features: int, rank: int, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors ``A`` and ``B`` of member seed ``seed`` for the weight ``name``.

    Args:
        noise (`NoiseSource`): The noise source.
        seed (`int`): The member seed (antithetic pairs share it).
        name (`str`): The parameter name (``"model.layers.0.self_attn.q_proj.weight"``).
        out_features (`int`), in_features (`int`): The weight's shape ``(out, in)``.
        rank (`int`): ``r``.
        device (`torch.device` or `str` or `None`): Device of the returned tensors (default CPU).

    Returns:
        `(A, B)`: float32 tensors of shapes ``(out, r)`` and ``(in, r)``, entries N(0, 1): the noise of the
        tensors ``name + ".lowrank_A"`` (``out * r`` elements) and ``name + ".lowrank_B"`` (``in * r`` elements).
    """
    a = full_noise(noise, seed, name + LOWRANK_A_SUFFIX, (out_features, rank), device=device)
    b = full_noise(noise, seed, name + LOWRANK_B_SUFFIX, (in_features, rank), device=device)
    return a, b


def lowrank_lora_factors(
    noise: NoiseSource, member: Member, name: str, shape, rank: int, sigma: float, dtype=torch.float32, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Member ``member``'s perturbation of weight ``name`` as LoRA factors (PEFT's layout, ``lora_alpha = r``):
    ``lora_B @ lora_A = E = sign * (sigma / sqrt(r)) * A @ B^T`` (EGGROLL, arXiv 2511.16652), with
    ``lora_A = B^T`` and ``lora_B = sign * (sigma / sqrt(r)) * A``; the per-row adapters of
    :class:`LowRankAdapters` compute the same product (``(x B) (s A^T)``).

    Args:
        noise (`NoiseSource`): The noise source.
        member (`Member`): Seed and sign.
        name (`str`): The parameter name.
        shape (`tuple[int, int]`): ``(out, in)``.
        rank (`int`): ``r``.
        sigma (`float`): The noise scale.
        dtype (`torch.dtype`): dtype of the returned factors (cast after scaling in fp32).
        device (`torch.device` or `str` or `None`): Their device.

    Returns:
        `(lora_A, lora_B)`: shapes ``(r, in)`` and ``(out, r)``, contiguous.
    """
    a, b = lowrank_factors(noise, member.seed, name, shape[0], shape[1], rank, device)
    lora_a = b.T.contiguous().to(dtype)
    lora_b = (a * (member.sign * float(sigma) / math.sqrt(rank))).to(dtype).contiguous()
    return lora_a, lora_b


def lowrank_perturbation(
    noise: NoiseSource, member: Member, name: str, shape, rank: int, sigma: float = 1.0, device=None
) -> torch.Tensor:
    """The dense perturbation ``E = sign * (sigma / sqrt(r)) * A @ B^T`` of one weight (for tests and analysis).

    Args:
        noise (`NoiseSource`): The noise source.
        member (`Member`): Seed and sign.
        name (`str`): The parameter name.
        shape (`tuple[int, int]`): ``(out, in)``.
        rank (`int`): ``r``.
        sigma (`float`): Noise scale (``1.0`` gives the update direction ``sign * A B^T / sqrt(r)``).

    Returns:
        `torch.Tensor`: float32, shape ``(out, in)``.
    """
    a, b = lowrank_factors(noise, member.seed, name, shape[0], shape[1], rank, device)
    return (a @ b.T) * (member.sign * float(sigma) / math.sqrt(rank))


class LowRankPerturbation(Perturbation):
    """Rank-``r`` noise ``eps_i = sign_i A_i B_i^T / sqrt(r)`` of every trained ``(out, in)`` weight (EGGROLL,
    Sarkar et al. 2025, arXiv 2511.16652). Applied as per-row adapters (:class:`LowRankAdapters`), never in place.

    The update direction of :meth:`direction_sums` is ``sum_i c_i sign_i A_i B_i^T / sqrt(r)``, one weight at a time,
    summed as rank-1 terms in a fixed order (members in population order, then rank index) with elementwise fp32
    operations only (no matmul reduction), so the trainer and ``replay`` get bitwise equal sums. Each member's
    perturbation is low-rank, but the sum over ``N`` members has rank up to ``N r``.

    Args:
        rank (`int`): ``r >= 1``.

    Raises:
        ValueError: if ``rank`` is not an integer >= 1.
    """

    name = "lowrank"

    def __init__(self, rank: int = 1):
        if isinstance(rank, bool) or int(rank) != rank or rank < 1:
            raise ValueError(f"noise_rank must be an integer >= 1, got {rank!r}.")
        self.rank = int(rank)

    def describe(self) -> dict:
        return {"type": self.name, "rank": self.rank}

    def check(self, params: TrainedParameters) -> None:
        """Every trained tensor must be a whole (unpartitioned) 2-D ``(out, in)`` weight.

        Raises:
            ValueError: naming the offending tensors and how to select Linear weights.
        """
        bad = [e.name for e in params.entries if e.param.dim() != 2 or e.start != 0 or e.param.numel() != e.numel]
        if bad:
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            raise ValueError(f"Cannot apply low-rank noise to {bad[:5]}{more}. {SELECT_HINT}")

    def factors(self, noise: NoiseSource, seed: int, entry: _Entry, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, B)`` of member seed ``seed`` for ``entry`` (see :func:`lowrank_factors`)."""
        out_features, in_features = entry.param.shape
        return lowrank_factors(noise, seed, entry.name, out_features, in_features, self.rank, device)

    def direction_sums(self, params, noise, members, coefficients):
        self.check(params)  # before any weight moves
        pairs = [(m, float(c) * m.sign / math.sqrt(self.rank))
                 for m, c in zip(members, coefficients, strict=True) if float(c) != 0.0]
        for e in params.entries:
            out_features, in_features = e.param.shape
            device = e.master.device
            total = torch.zeros(out_features, in_features, dtype=torch.float32, device=device)
            for member, coef in pairs:
                a, b = self.factors(noise, member.seed, e, device)
                a = a * coef
                for j in range(self.rank):
                    if noise.portable:  # an outer product (one rounding each), then an add: the same on every CPU
                        total.add_(a[:, j : j + 1] * b[:, j].unsqueeze(0))
                    else:  # version-1 seed logs naming no generator (arithmetic.py)
                        total.addcmul_(a[:, j : j + 1], b[:, j].unsqueeze(0))
            yield e, 0, e.param.numel(), total.view(-1)


def linear_targets(model: nn.Module, params: TrainedParameters) -> list[tuple[_Entry, list[nn.Linear]]]:
    """Match every trained entry to the ``nn.Linear`` modules whose ``weight`` it is.

    Args:
        model (`nn.Module`): The (unwrapped) model holding ``params``.
        params (`TrainedParameters`): The trained parameters.

    Returns:
        `list[(entry, modules)]`: One item per entry, in ``params.entries`` order.

    Raises:
        ValueError: if an entry is not (only) the weight of ``nn.Linear`` modules, or is partitioned. The message
            names the offending parameters and how to select Linear weights with ``include_parameters``.
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if p.numel():
                owners.setdefault(p.data_ptr(), []).append((module, pname))
    matched, bad = [], []
    for e in params.entries:
        found = owners.get(e.param.data_ptr(), []) if e.param.numel() else []
        linears = [m for m, pname in found if isinstance(m, nn.Linear) and pname == "weight"
                   and m.weight.shape == e.param.shape]
        if (e.param.dim() != 2 or e.start != 0 or e.param.numel() != e.numel or not linears
                or len(linears) != len(found)):
            bad.append(e.name)
        else:
            matched.append((e, linears))
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise ValueError(f"Cannot perturb {bad[:5]}{more} with low-rank noise. {SELECT_HINT}")
    return matched


def linear_weight_names(model: nn.Module) -> list[str]:
    """Names of the trainable weights of ``nn.Linear`` modules that belong to nothing else (not tied to an embedding).

    The default selection of the low-rank backend. Returns names in ``named_parameters()`` order.
    """
    owners: dict[int, int] = {}
    for module in model.modules():
        for _, p in module.named_parameters(recurse=False):
            owners[p.data_ptr()] = owners.get(p.data_ptr(), 0) + 1
    linear_ptrs = {m.weight.data_ptr() for m in model.modules()
                   if isinstance(m, nn.Linear) and m.weight is not None}
    names = []
    for name, p in model.named_parameters():
        ptr = p.data_ptr()
        if p.requires_grad and p.dim() == 2 and ptr in linear_ptrs and owners.get(ptr, 0) == 1:
            names.append(name)
    return names


class _RowBlockAdapter:
    """The forward hook of one ``nn.Linear``: adds ``(x B_k) (s_k A_k^T)`` to the rows of block ``k``.

    Holds fixed-shape factor buffers ``b`` (``(M, in, r)``) and ``at`` (``(M, r, out)``, scaled by
    ``sign * sigma / sqrt(r)``) in the Linear's dtype, written in place by :meth:`LowRankAdapters.load_`. Inactive
    (``active = False``) it leaves the output untouched.
    """

    def __init__(self, name: str):
        self.name = name
        self.active = False
        self.count = 0
        self.b: torch.Tensor | None = None
        self.at: torch.Tensor | None = None

    def __call__(self, module, args, kwargs, output):
        if not self.active:
            return None
        x = args[0] if args else kwargs["input"]
        count = self.count
        batch = x.shape[0]
        if batch % count:
            raise ValueError(f"Batched low-rank population: the input of {self.name!r} has batch size {batch}, not a "
                             f"multiple of the {count} stacked members.")
        x = x.reshape(count, -1, x.shape[-1])
        b, at = self.b[:count], self.at[:count]
        if x.dtype != b.dtype:
            x = x.to(b.dtype)
        low = torch.bmm(x, b).to(output.dtype)  # (M, rows * tokens, r)
        at = at.to(output.dtype)
        if output.is_contiguous() and not (output.requires_grad and torch.is_grad_enabled()):
            # in place (generation runs under no_grad): no new activation-sized tensor, one pass over the output
            output.view(count, -1, output.shape[-1]).baddbmm_(low, at)
            return output
        flat = output.reshape(count, -1, output.shape[-1])
        return torch.baddbmm(flat, low, at).view(output.shape)


class LowRankAdapters:
    """Persistent per-row-block low-rank adapters on the targeted ``nn.Linear`` modules (multi-LoRA style).

    One forward hook per targeted Linear is registered **once**, at construction, and stays until :meth:`remove`.
    :meth:`load_` writes the factors of ``M`` members into fixed-shape buffers (reused while ``M`` and the dtype do
    not change) and activates the adapters: in every forward, the batch (first) dimension ``b`` of each targeted
    Linear's input is split into ``M`` equal blocks, and block ``k`` computes

        y = x W^T + (sign_k sigma / sqrt(r)) (x B_k) A_k^T,

    i.e. sees ``W + E_k`` (two batched matmuls per call, no Python loop over members; under ``no_grad`` the second
    adds into the Linear's output in place). Blocks keep their rows through ``generate`` (greedy or sampling, with or
    without KV cache), so the map holds at every decoding step, and a batch of ``M`` rows (one shared prompt prefix
    per member) works too. :meth:`clear_` deactivates the adapters: the model is then exactly the unperturbed one.
    The weights are never modified.

    Args:
        model (`nn.Module`): The (unwrapped) model holding ``params``.
        params (`TrainedParameters`): The trained parameters: all must be ``nn.Linear`` weights.
        perturbation (`LowRankPerturbation`): The rank and factor layout.

    Raises:
        ValueError: see :func:`linear_targets`.
    """

    def __init__(self, model: nn.Module, params: TrainedParameters, perturbation: LowRankPerturbation):
        self.model, self.params, self.perturbation = model, params, perturbation
        self.targets = linear_targets(model, params)
        self._adapters: list[_RowBlockAdapter] = []
        self._handles = []
        try:
            for entry, modules in self.targets:
                adapter = _RowBlockAdapter(entry.name)
                self._adapters.append(adapter)
                for module in modules:
                    self._handles.append(module.register_forward_hook(adapter, with_kwargs=True))
        except BaseException:
            self.remove()
            raise

    @property
    def active(self) -> bool:
        return any(a.active for a in self._adapters)

    def load_(self, noise: NoiseSource, members: Sequence[Member], sigma: float) -> None:
        """Write the factors of ``members`` (in row-block order) into the buffers and activate the adapters.

        Antithetic pairs share their factors (generated once). Buffers are reallocated only when the number of
        members grows or the dtype/device changes.
        """
        rank = self.perturbation.rank
        count = len(members)
        for (entry, _), adapter in zip(self.targets, self._adapters, strict=True):
            out_features, in_features = entry.param.shape
            device, dtype = entry.param.device, entry.param.dtype
            if (adapter.b is None or adapter.b.shape[0] < count or adapter.b.dtype != dtype
                    or adapter.b.device != device):
                adapter.b = torch.empty(count, in_features, rank, dtype=dtype, device=device)
                adapter.at = torch.empty(count, rank, out_features, dtype=dtype, device=device)
            cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for k, member in enumerate(members):
                if member.seed not in cache:
                    cache[member.seed] = self.perturbation.factors(noise, member.seed, entry, device)
                a, b = cache[member.seed]
                adapter.b[k].copy_(b)
                adapter.at[k].copy_(a.T * (member.sign * float(sigma) / math.sqrt(rank)))
            adapter.count = count
        for adapter in self._adapters:
            adapter.active = True

    def clear_(self) -> None:
        """Deactivate every adapter (the model computes ``x W^T`` again); buffers are kept for the next load."""
        for adapter in self._adapters:
            adapter.active = False

    @contextlib.contextmanager
    def members(self, noise: NoiseSource, members: Sequence[Member], sigma: float) -> Iterator[None]:
        """Context in which row block ``k`` of every forward sees ``W + E_{members[k]}``; cleared on exit, also on
        an exception (``KeyboardInterrupt`` included)."""
        try:
            self.load_(noise, members, sigma)
            yield
        finally:
            self.clear_()

    def remove(self) -> None:
        """Unregister the hooks (the adapters can no longer be activated)."""
        self.clear_()
        for handle in self._handles:
            handle.remove()
        self._handles = []


PERTURBATIONS = {"gaussian": GaussianPerturbation, "lowrank": LowRankPerturbation}


def perturbation_from_description(description: dict) -> Perturbation:
    """Inverse of :meth:`Perturbation.describe` (used by ``replay``).

    Raises:
        ValueError: for an unknown type.
    """
    facts = dict(description)
    kind = facts.pop("type")
    if kind not in PERTURBATIONS:
        raise ValueError(f"Unknown perturbation type {kind!r}: expected one of {tuple(PERTURBATIONS)}.")
    return PERTURBATIONS[kind](**facts)
