"""The ES state (the fp32 master copy of the trained parameters), the ES step and Anchored Weight Decay.

The model's parameters hold ``cast(master)``; entries may be ZeRO-3 partitions ``[start, start + local numel)`` of
their flattened tensor.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .arithmetic import add_scaled_
from .noise import NoiseSource


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
