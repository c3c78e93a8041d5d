"""How noise touches the weights: the trained parameters with their fp32 master, the perturbations ``eps_i``, the ES
step, and the bitwise-exact arithmetic they share.

- Trained parameters (:class:`TrainedParameters`): the model's parameters hold ``cast(master)``; entries may be ZeRO-3
  partitions ``[start, start + local numel)`` of their flattened tensor; Anchored Weight Decay steps the master.
- Perturbations: :class:`GaussianPerturbation` writes ``theta + sign sigma eps`` into the weights in place;
  :class:`LowRankPerturbation` adds ``E_i = sign_i (sigma / sqrt(r)) A_i B_i^T`` (``A_i``: ``(out, r)``, ``B_i``:
  ``(in, r)``, N(0, 1) entries; Sarkar et al. 2025, arXiv 2511.16652) to member ``i``'s rows through
  :class:`LowRankAdapters`. Both give the fp32 update direction ``sum_i c_i sign_i eps_i``
  (:meth:`Perturbation.direction_sums`), bitwise the same everywhere.
- The update: :func:`es_update_` (the ES step into the master) and :func:`es_gradient_` (the same direction as a
  gradient for a torch optimizer).
- Bitwise-exact arithmetic: torch's CPU kernels fuse ``y + alpha * x`` into one rounding where the CPU has FMA and
  reduce in an order set by the SIMD width; here each step is one correctly rounded IEEE operation per element and
  small sums are exactly rounded (:func:`math.fsum`), so a seed log replays to the same weights on any CPU.
"""

from __future__ import annotations

import contextlib
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .noise import NOISE_BLOCK_SIZE, NoiseSource, full_noise


# -------------------------------------------------------------------------------------------- bitwise-exact arithmetic
def add_scaled_(y: torch.Tensor, x: torch.Tensor, alpha: float, portable: bool = True) -> torch.Tensor:
    """``y += alpha * x`` in place, returns ``y``; ``portable=False``: torch's fused one-pass add (legacy seed logs)."""
    if portable:  # a multiply, then an add: two IEEE roundings, the same bits on every CPU
        return y.add_(x * alpha)
    return y.add_(x, alpha=alpha)  # fused into one rounding on FMA CPUs: kept for version-1 logs


def added_scaled(y: torch.Tensor, x: torch.Tensor, alpha: float, portable: bool = True,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``y + alpha * x`` as a new tensor (or into ``out``) of ``torch.add``'s dtype, rounded as :func:`add_scaled_`."""
    if portable:
        return torch.add(y, x * alpha, out=out) if out is not None else torch.add(y, x * alpha)
    return torch.add(y, x, alpha=alpha, out=out) if out is not None else torch.add(y, x, alpha=alpha)


def exact_sum(values: Iterable[float]) -> float:
    """The exactly rounded float64 sum (:func:`math.fsum`): independent of order and CPU. NaN in, NaN out."""
    return math.fsum(float(v) for v in values)


def exact_mean(values: torch.Tensor) -> float:
    """Mean of a 1-D tensor: the exactly rounded float64 sum over the count; ``ValueError`` when empty."""
    if values.numel() == 0:
        raise ValueError("exact_mean of an empty tensor.")
    return exact_sum(values.reshape(-1).tolist()) / values.numel()


def zscore(values: torch.Tensor) -> torch.Tensor:
    """``(v - mean(v)) / std(v)``, ddof 0, the same bits on every CPU: ``(N,)`` finite, not all equal, to float64."""
    v = values.to(torch.float64)
    centered = v - exact_mean(v)  # torch's mean/std reduce in an order set by the SIMD width
    std = math.sqrt(exact_sum((centered * centered).tolist()) / v.numel())
    return centered / std


# -------------------------------------------------------------------------------------------------- trained parameters
AWD_PENALTIES = ("l2", "l1")


@dataclass
class Member:
    """One population member: the noise ``sign * eps(seed)`` (antithetic pairs share a seed, signs ``+1, -1``)."""

    seed: int  # keys the noise eps (trl_es.es.noise)
    sign: int = 1


@dataclass
class _Entry:
    name: str
    param: torch.Tensor  # the model's tensor (or local partition), any float dtype
    master: torch.Tensor  # same shape, fp32 by default; may be ``param`` itself (see master_is_param)
    numel: int  # elements of the whole (unpartitioned) tensor
    start: int = 0  # flat index of param's first element in the whole tensor

    @property
    def master_is_param(self) -> bool:
        """Whether the master and the model's tensor are one tensor (no copy)."""
        return self.master.data_ptr() == self.param.data_ptr() and self.master.dtype == self.param.dtype


def select_parameters(
    model: nn.Module, include: str | None = None, exclude: str | None = None
) -> list[tuple[str, nn.Parameter]]:
    """The parameters ES trains (``requires_grad``, floating point), kept by ``include`` and dropped by ``exclude``
    (``re.search``), in ``named_parameters()`` order; ``ValueError`` for a bad pattern or an empty selection.
    """
    try:
        include_re = re.compile(include) if include else None
        exclude_re = re.compile(exclude) if exclude else None
    except re.error as error:
        raise ValueError(f"Invalid regular expression in include_parameters/exclude_parameters: {error}") from error
    selected = [
        (name, p)
        for name, p in model.named_parameters()
        if p.requires_grad  # with PEFT, only the adapter
        and p.is_floating_point()
        and (include_re is None or include_re.search(name))
        and not (exclude_re is not None and exclude_re.search(name))
    ]
    if not selected:
        raise ValueError(
            "No parameter selected for ES: check include_parameters/exclude_parameters and that the model has "
            "trainable (requires_grad) floating-point parameters."
        )
    return selected


class TrainedParameters:
    """The trained parameters of a model and their master copy (one :class:`_Entry` each).

    Raises:
        ValueError: for a non-contiguous tensor.
    """

    def __init__(self, named_params: Iterable, master_dtype: torch.dtype | None = torch.float32,
                 share_params: bool = False):
        # named_params: (name, tensor) pairs, or (name, local, numel, start) for a ZeRO-3 partition
        self.entries: list[_Entry] = []
        self.master_dtype = master_dtype  # None: each parameter's own dtype
        # a parameter already in the master dtype is its own master (no copy): only for perturbations that never
        # write into the weights (low-rank adapters); an in-place perturbation refuses such entries
        self.share_params = bool(share_params)
        for item in named_params:
            name, param = item[0], item[1]
            numel = item[2] if len(item) > 2 else param.numel()
            start = item[3] if len(item) > 3 else 0
            data = param.data if isinstance(param, nn.Parameter) else param
            if not data.is_contiguous():  # perturbations write flattened views in place
                raise ValueError(f"Parameter {name!r} is not contiguous; ES perturbs flattened views in place.")
            dtype = master_dtype or data.dtype  # None saves memory; the update is still summed in fp32
            if self.share_params and dtype == data.dtype:
                master = data.detach()
            else:
                master = data.detach().to(dtype=dtype, copy=True)
            self.entries.append(_Entry(name, data, master, int(numel), int(start)))
        self.perturbed = False  # True between an in-place perturbation and the next write_master_to_model_

    # ------------------------------------------------------------------ bookkeeping
    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def numel(self) -> int:
        """Number of locally held trained elements."""
        return sum(e.param.numel() for e in self.entries)

    @property
    def master_bytes(self) -> int:
        """Bytes held by master copies distinct from the model's tensors (0 when every master is its parameter)."""
        return sum(e.master.numel() * e.master.element_size() for e in self.entries if not e.master_is_param)

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """The master tensors by name (views, not copies)."""
        return {e.name: e.master for e in self.entries}

    def load_master_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy master values from ``state`` and write them into the model; a missing name raises ``KeyError``."""
        for e in self.entries:
            if e.name not in state:
                raise KeyError(f"Master state has no tensor for parameter {e.name!r}.")
            e.master.copy_(state[e.name].view_as(e.master))
        self.write_master_to_model_()

    def refresh_master_from_model_(self) -> None:
        """Set the master to the model's current values (after the model was loaded from a checkpoint)."""
        for e in self.entries:
            if not e.master_is_param:
                e.master.copy_(e.param)

    def rebind_(self, name: str, tensor: torch.Tensor) -> None:
        """Point entry ``name`` at the model's new storage ``tensor``, keeping its master; ``RuntimeError`` if the shape
        changed (or the dtype of a parameter that is its own master), ``KeyError`` for an unknown ``name``.
        """
        for e in self.entries:
            if e.name != name:
                continue
            if tensor.shape != e.param.shape:
                raise RuntimeError(f"Parameter {name!r} changed shape while the model was prepared.")
            if e.master_is_param and tensor.dtype != e.param.dtype:
                raise RuntimeError(f"Parameter {name!r} changed dtype ({e.param.dtype} -> {tensor.dtype}) while the "
                                   "model was prepared; it was its own master, which would lose its precision.")
            shared = e.master_is_param
            e.param = tensor
            if shared:  # a master that was its parameter follows the new storage
                e.master = tensor.detach()
            return
        raise KeyError(name)

    # ------------------------------------------------------------------ write / restore
    def write_master_to_model_(self) -> None:
        """Write ``cast(master)`` into the model's tensors (rounded to their dtype): after an update, and as the
        exact restore after a member.
        """
        with torch.no_grad():
            for e in self.entries:
                if not e.master_is_param:  # exact, unlike subtracting the noise again as the reference code does
                    e.param.copy_(e.master)
        self.perturbed = False

    def master_parameters(self) -> list[torch.Tensor]:
        """The master tensors as leaf tensors an optimizer can own (``requires_grad`` is not needed)."""
        return [e.master for e in self.entries]

    # ------------------------------------------------------------------ AWD
    def anchored_weight_decay_(self, anchor, shrink: float, penalty: str = "l2") -> None:
        """Anchored Weight Decay (arXiv 2605.30148, Algorithm 1) toward ``anchor`` (``theta_0`` by name, the local
        partition, any device and float dtype) on the master in fp32, then write the model; ``shrink = alpha * lambda``.

        Raises:
            ValueError: for an unknown penalty or ``shrink`` outside ``[0, 1)`` with ``"l2"``.
        """
        if penalty not in AWD_PENALTIES:
            raise ValueError(f"awd_penalty must be one of {AWD_PENALTIES}, got {penalty!r}.")
        if penalty == "l2" and not 0 <= shrink < 1:
            raise ValueError(f"AWD with the l2 penalty needs 0 <= learning_rate * awd_lambda < 1, got {shrink}.")
        with torch.no_grad():
            for e in self.entries:
                # one anchor tensor at a time: a lazily loading mapping (FileAnchor) works
                theta0 = anchor[e.name].to(device=e.master.device, dtype=torch.float32).view_as(e.master)
                delta = e.master.float() - theta0
                if penalty == "l2":
                    delta.mul_(1.0 - shrink)  # delta <- (1 - shrink) delta
                else:
                    delta = torch.sign(delta) * torch.clamp(delta.abs() - shrink, min=0.0)  # soft threshold
                e.master.copy_(theta0 + delta)  # theta = theta_0 + delta
        self.write_master_to_model_()


# ------------------------------------------------------------------------------------------------------- perturbations
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
    """What the noise ``eps_i`` of a member is, and the direction sum of an update along it."""

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
        ``[lo, hi)`` of ``entry`` (float32, ``(hi - lo,)``), every local element of every entry once, members in
        population order (zero coefficients skipped).
        """


class GaussianPerturbation(Perturbation):
    """Full-rank Gaussian noise, one N(0, 1) entry per trained element (Qiu et al. 2025, arXiv 2509.24372,
    Algorithm 1), written in place; works on partitions (ZeRO-3).
    """

    name = "gaussian"

    def perturb_(self, params: TrainedParameters, noise: NoiseSource, member: Member, sigma: float) -> None:
        """Write ``cast(master + sign * sigma * eps)`` into the model, in fp32, block by block.

        Raises:
            ValueError: if a master aliases its parameter (a perturbation in place would destroy the weights).
        """
        if any(e.master_is_param for e in params.entries):
            raise ValueError("In-place perturbation needs a master copy distinct from the model's weights.")
        with torch.no_grad():
            for e in params.entries:  # only the locally held elements (ZeRO-3 partitions)
                _write_perturbed(e.param.view(-1), e.master.view(-1), noise, member, sigma, e.name, e.numel, e.start)
        params.perturbed = True

    @staticmethod
    @torch.no_grad()
    def perturbed_tensor(master: torch.Tensor, noise: NoiseSource, member: Member, sigma: float, name: str,
                         dtype: torch.dtype) -> torch.Tensor:
        """``cast(master + sign * sigma * eps)`` of one whole tensor as a new ``dtype`` tensor of ``master``'s shape
        and device: bitwise what :meth:`perturb_` writes (for an engine that loads member weights itself).
        """
        out = torch.empty(master.shape, dtype=dtype, device=master.device)
        _write_perturbed(out.view(-1), master.reshape(-1), noise, member, sigma, name, master.numel(), 0)
        return out

    def direction_sums(self, params, noise, members, coefficients):
        # members in population order, zero coefficients skipped: the same sum on every process and in replay
        pairs = [(m, float(c) * m.sign) for m, c in zip(members, coefficients, strict=True) if float(c) != 0.0]
        for e in params.entries:
            local = e.param.numel()
            device = e.master.device
            position = 0
            while position < local:
                hi = min(local, position + _block_span(e.start + position))  # one noise block of memory at a time
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
        if flat_param.dtype == torch.float32 and flat_master.dtype == torch.float32:  # straight into the param
            added_scaled(flat_master[lo:hi], eps, scale, noise.portable, out=flat_param[lo:hi])
        else:  # in fp32, then one rounding to the param's dtype
            flat_param[lo:hi].copy_(added_scaled(flat_master[lo:hi].float(), eps, scale, noise.portable))


def _block_span(position: int) -> int:
    """Elements from ``position`` to the end of its noise block (sums are formed per noise block)."""
    return NOISE_BLOCK_SIZE - position % NOISE_BLOCK_SIZE


# ---------------------------------------------------------------------------------------------- low rank
def lowrank_factors(
    noise: NoiseSource, seed: int, name: str, out_features: int, in_features: int, rank: int, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` of member seed ``seed`` for weight ``name`` ``(out, in)``: float32, ``(out, r)`` and ``(in, r)``,
    N(0, 1), the noise of ``name + ".lowrank_A"`` and ``name + ".lowrank_B"``.
    """
    a = full_noise(noise, seed, name + LOWRANK_A_SUFFIX, (out_features, rank), device=device)
    b = full_noise(noise, seed, name + LOWRANK_B_SUFFIX, (in_features, rank), device=device)
    return a, b


def lowrank_lora_factors(
    noise: NoiseSource, member: Member, name: str, shape, rank: int, sigma: float, dtype=torch.float32, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Member ``member``'s perturbation of weight ``name`` as PEFT LoRA factors (``lora_alpha = r``):
    ``(lora_A, lora_B)`` of shapes ``(r, in)`` and ``(out, r)`` with ``lora_B @ lora_A = sign (sigma / sqrt(r)) A B^T``
    (EGGROLL, arXiv 2511.16652), scaled in fp32 then cast to ``dtype``.
    """
    a, b = lowrank_factors(noise, member.seed, name, shape[0], shape[1], rank, device)
    lora_a = b.T.contiguous().to(dtype)  # the same product as LowRankAdapters' (x B) (s A^T)
    lora_b = (a * (member.sign * float(sigma) / math.sqrt(rank))).to(dtype).contiguous()
    return lora_a, lora_b


def lowrank_perturbation(
    noise: NoiseSource, member: Member, name: str, shape, rank: int, sigma: float = 1.0, device=None
) -> torch.Tensor:
    """The dense ``E = sign * (sigma / sqrt(r)) * A @ B^T`` of one weight: float32, ``(out, in)`` (tests, analysis)."""
    a, b = lowrank_factors(noise, member.seed, name, shape[0], shape[1], rank, device)
    return (a @ b.T) * (member.sign * float(sigma) / math.sqrt(rank))


class LowRankPerturbation(Perturbation):
    """Rank-``r`` noise ``eps_i = sign_i A_i B_i^T / sqrt(r)`` of every trained ``(out, in)`` weight (EGGROLL,
    Sarkar et al. 2025, arXiv 2511.16652), applied as per-row adapters, never in place.

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
        # the sum over N members has rank up to N r, so it is formed densely, one weight at a time
        pairs = [(m, float(c) * m.sign / math.sqrt(self.rank))
                 for m, c in zip(members, coefficients, strict=True) if float(c) != 0.0]
        # rank-1 terms in a fixed order, elementwise fp32 (no matmul reduction): bitwise equal in trainer and replay
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
    """Match every trained entry (in order) to the ``nn.Linear`` modules whose ``weight`` it is.

    Raises:
        ValueError: if an entry is not (only) the weight of ``nn.Linear`` modules, or is partitioned, naming them.
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if p.numel():  # keyed by storage: tied weights share one pointer
                owners.setdefault(p.data_ptr(), []).append((module, pname))
    matched, bad = [], []
    for e in params.entries:
        found = owners.get(e.param.data_ptr(), []) if e.param.numel() else []
        linears = [m for m, pname in found if isinstance(m, nn.Linear) and pname == "weight"
                   and m.weight.shape == e.param.shape]
        # a whole 2-D weight, owned only by Linear modules as their weight (not tied to an embedding)
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
    """Trainable ``nn.Linear`` weights not tied to another module, in ``named_parameters()`` order (the low-rank
    default selection).
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
        if p.requires_grad and p.dim() == 2 and ptr in linear_ptrs and owners.get(ptr, 0) == 1:  # untied
            names.append(name)
    return names


class _RowBlockAdapter:
    """Forward hook of one ``nn.Linear``: adds ``(x B_k) (s_k A_k^T)`` to the rows of block ``k`` while active."""

    def __init__(self, name: str):
        self.name = name
        self.active = False
        self.count = 0
        self.b: torch.Tensor | None = None  # (M, in, r), the Linear's dtype, written by LowRankAdapters.load_
        self.at: torch.Tensor | None = None  # (M, r, out), scaled by sign * sigma / sqrt(r)

    def __call__(self, module, args, kwargs, output):
        if not self.active:
            return None
        x = args[0] if args else kwargs["input"]
        count = self.count
        batch = x.shape[0]
        if batch % count:
            raise ValueError(f"Batched low-rank population: the input of {self.name!r} has batch size {batch}, not a "
                             f"multiple of the {count} stacked members.")
        # row blocks keep their rows through generate (with or without KV cache): the map holds at every step
        x = x.reshape(count, -1, x.shape[-1])
        b, at = self.b[:count], self.at[:count]  # buffers may hold more members than this group
        if x.dtype != b.dtype:
            x = x.to(b.dtype)
        low = torch.bmm(x, b).to(output.dtype)  # (M, rows * tokens, r)
        at = at.to(output.dtype)
        if output.is_contiguous() and not (output.requires_grad and torch.is_grad_enabled()):
            # in place (generation runs under no_grad): no new activation-sized tensor, one pass over the output
            output.view(count, -1, output.shape[-1]).baddbmm_(low, at)
            return output
        flat = output.reshape(count, -1, output.shape[-1])  # autograd needs a new tensor
        return torch.baddbmm(flat, low, at).view(output.shape)


class LowRankAdapters:
    """Persistent per-row-block low-rank adapters on the targeted ``nn.Linear`` modules (multi-LoRA style): with
    ``M`` members loaded, row block ``k`` computes ``x W^T + (sign_k sigma / sqrt(r)) (x B_k) A_k^T``.

    Raises:
        ValueError: see :func:`linear_targets`.
    """

    def __init__(self, model: nn.Module, params: TrainedParameters, perturbation: LowRankPerturbation):
        self.model, self.params, self.perturbation = model, params, perturbation
        self.targets = linear_targets(model, params)  # hooks registered once, here, until remove()
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
        """Write the factors of ``members`` (in row-block order) into the buffers and activate the adapters."""
        rank = self.perturbation.rank
        count = len(members)
        for (entry, _), adapter in zip(self.targets, self._adapters, strict=True):
            out_features, in_features = entry.param.shape
            device, dtype = entry.param.device, entry.param.dtype
            # buffers reallocated only when the members grow or the dtype/device changes
            if (adapter.b is None or adapter.b.shape[0] < count or adapter.b.dtype != dtype
                    or adapter.b.device != device):
                adapter.b = torch.empty(count, in_features, rank, dtype=dtype, device=device)
                adapter.at = torch.empty(count, rank, out_features, dtype=dtype, device=device)
            cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for k, member in enumerate(members):
                if member.seed not in cache:  # antithetic pairs share their factors
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


# ---------------------------------------------------------------------------------------------------------- the update
def es_update_(
    params: TrainedParameters, perturbation, noise: NoiseSource, members: Sequence[Member],
    coefficients: Sequence[float], learning_rate: float,
) -> None:
    """The ES step ``theta <- theta + alpha / N * sum_i z_i * eps_i`` in fp32 into the master, then write the model
    (Qiu et al. 2025, arXiv 2509.24372, Algorithm 1, sigma folded into ``alpha``).

    Raises:
        ValueError: if the perturbation cannot apply to a trained tensor (nothing is changed then).
    """
    perturbation.check(params)
    step = float(learning_rate) / len(members)
    with torch.no_grad():  # streamed: the extra memory is one noise block or one weight matrix
        for e, lo, hi, total in perturbation.direction_sums(params, noise, members, coefficients):
            flat = e.master.view(-1)[lo:hi]
            if flat.dtype == torch.float32:  # steps below a 16-bit ulp accumulate in the fp32 master
                add_scaled_(flat, total, step, noise.portable)
            else:  # master_dtype=None: summed in fp32, rounded once per step
                flat.copy_(add_scaled_(flat.float(), total, step, noise.portable))
    params.write_master_to_model_()


def es_gradient_(
    params: TrainedParameters, perturbation, noise: NoiseSource, members: Sequence[Member],
    coefficients: Sequence[float],
) -> None:
    """Store ``-(1 / N) * sum_i z_i * eps_i`` in ``master.grad`` (fp32) for a torch optimizer (Salimans et al. 2017,
    arXiv 1703.03864, Eq. 2); SGD with ``lr = alpha`` reproduces :func:`es_update_`.

    Raises:
        ValueError: if a master is not fp32 (``es_optimizer='torch'`` needs ``fp32_master_weights=True``).
    """
    perturbation.check(params)
    scale = -1.0 / len(members)  # negated: torch optimizers minimize
    for e in params.entries:
        if e.master.dtype != torch.float32:
            raise ValueError("es_optimizer='torch' needs an fp32 master copy (fp32_master_weights=True).")
    for e in params.entries:
        e.master.grad = torch.zeros_like(e.master)
    for e, lo, hi, total in perturbation.direction_sums(params, noise, members, coefficients):
        add_scaled_(e.master.grad.view(-1)[lo:hi], total, scale, noise.portable)
