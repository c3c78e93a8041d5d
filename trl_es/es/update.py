"""The ES state (an fp32 master copy of the trained parameters), perturb/restore, the ES step and AWD.

The trained parameters' true values live in the *master* tensors (fp32 by default). The model's own parameters are
a rendering of the master (a cast, for a bf16/fp16 model). Hence:

- perturb writes ``cast(master + sign * sigma * eps)`` into the model, in fp32, block by block;
- restore writes ``cast(master)`` back: bitwise exact whatever the dtype and however many cycles (subtracting the
  noise again, as the public reference code does, is not exact in floating point);
- the update is accumulated in fp32 into the master, so steps smaller than a 16-bit ulp are not lost.

Everything here works on *partitions*: an entry may hold only the elements ``[start, start + local numel)`` of its
flattened tensor (DeepSpeed ZeRO-3), and noise is generated only for those elements.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .noise import NOISE_BLOCK_SIZE, NoiseSource

AWD_PENALTIES = ("l2", "l1")


@dataclass
class Member:
    """One population member: the noise ``sign * eps(seed)``.

    Attributes:
        seed (`int`): Seed of the noise ``eps`` (see :mod:`trl_es.es.noise`).
        sign (`int`): ``+1`` or ``-1`` (antithetic pairs share a seed with opposite signs).
    """

    seed: int
    sign: int = 1


@dataclass
class _Entry:
    name: str
    param: torch.Tensor  # the model's tensor (or local partition), any float dtype
    master: torch.Tensor  # same shape, fp32 by default
    numel: int  # elements of the whole (unpartitioned) tensor
    start: int = 0  # flat index of param's first element in the whole tensor


def select_parameters(
    model: nn.Module, include: str | None = None, exclude: str | None = None
) -> list[tuple[str, nn.Parameter]]:
    """The parameters ES trains: those with ``requires_grad`` (so with PEFT only the adapter), then filtered.

    Args:
        model (`nn.Module`): The (unwrapped) model.
        include (`str` or `None`): If set, keep only names matching this regular expression (``re.search``).
        exclude (`str` or `None`): If set, drop names matching this regular expression.

    Returns:
        `list[tuple[str, nn.Parameter]]`: In ``named_parameters()`` order (tied weights appear once).

    Raises:
        ValueError: if a regular expression is invalid or no parameter is selected.
    """
    try:
        include_re = re.compile(include) if include else None
        exclude_re = re.compile(exclude) if exclude else None
    except re.error as error:
        raise ValueError(f"Invalid regular expression in include_parameters/exclude_parameters: {error}") from error
    selected = [
        (name, p)
        for name, p in model.named_parameters()
        if p.requires_grad
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
    """The trained parameters of a model and their master copy.

    Args:
        named_params (`Iterable[tuple[str, torch.Tensor]]`): The parameters (e.g. from :func:`select_parameters`).
            Each tensor must be contiguous. For a partitioned tensor pass a ``(name, local, numel, start)`` tuple.
        master_dtype (`torch.dtype`): dtype of the master copy. ``torch.float32`` (default) keeps an fp32 master
            of 16-bit parameters; ``None`` keeps it in each parameter's own dtype (saves memory for bf16/fp16
            models; the update is still summed in fp32 and rounded once per step).
    """

    def __init__(self, named_params: Iterable, master_dtype: torch.dtype | None = torch.float32):
        self.entries: list[_Entry] = []
        for item in named_params:
            name, param = item[0], item[1]
            numel = item[2] if len(item) > 2 else param.numel()
            start = item[3] if len(item) > 3 else 0
            data = param.data if isinstance(param, nn.Parameter) else param
            if not data.is_contiguous():
                raise ValueError(f"Parameter {name!r} is not contiguous; ES perturbs flattened views in place.")
            master = data.detach().to(dtype=master_dtype or data.dtype, copy=True)
            self.entries.append(_Entry(name, data, master, int(numel), int(start)))
        self._perturbed = False

    # ------------------------------------------------------------------ bookkeeping
    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def numel(self) -> int:
        """Number of locally held trained elements."""
        return sum(e.param.numel() for e in self.entries)

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """The master tensors by name (views, not copies)."""
        return {e.name: e.master for e in self.entries}

    def load_master_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy master values from ``state`` (missing or mis-shaped names raise) and render them into the model."""
        for e in self.entries:
            if e.name not in state:
                raise KeyError(f"Master state has no tensor for parameter {e.name!r}.")
            e.master.copy_(state[e.name].view_as(e.master))
        self.render_()

    def refresh_master_from_model_(self) -> None:
        """Set the master to the model's current values (after the model was loaded from a checkpoint)."""
        for e in self.entries:
            e.master.copy_(e.param)

    # ------------------------------------------------------------------ perturb / restore
    def render_(self) -> None:
        """Write ``cast(master)`` into the model: the exact restore."""
        with torch.no_grad():
            for e in self.entries:
                e.param.copy_(e.master)
        self._perturbed = False

    restore_ = render_

    def perturb_(self, noise: NoiseSource, member: Member, sigma: float) -> None:
        """Write ``cast(master + sign * sigma * eps)`` into the model, in fp32, block by block.

        Args:
            noise (`NoiseSource`): The noise source.
            member (`Member`): The member (seed and sign).
            sigma (`float`): The noise scale.
        """
        scale = float(member.sign) * float(sigma)
        with torch.no_grad():
            for e in self.entries:
                flat_param, flat_master = e.param.view(-1), e.master.view(-1)
                pieces = noise.pieces(member.seed, e.name, e.numel, e.start, e.start + flat_param.numel(),
                                      device=flat_param.device)
                for lo, hi, eps in pieces:
                    if flat_param.dtype == torch.float32 and flat_master.dtype == torch.float32:
                        torch.add(flat_master[lo:hi], eps, alpha=scale, out=flat_param[lo:hi])  # one pass
                    else:
                        flat_param[lo:hi].copy_(torch.add(flat_master[lo:hi].float(), eps, alpha=scale))
        self._perturbed = True

    # ------------------------------------------------------------------ the ES step
    def noise_sum(self, noise: NoiseSource, members: Sequence[Member], coefficients: Sequence[float]):
        """Yield ``(entry, lo, hi, s)`` with ``s = sum_i coefficients[i] * sign_i * eps_i`` (fp32) for each block.

        The sum is formed in a fixed order (members in population order, blocks in flat order), so every process
        and ``replay`` obtain bitwise identical results.
        """
        pairs = [(m, float(c) * m.sign) for m, c in zip(members, coefficients, strict=True) if float(c) != 0.0]
        for e in self.entries:
            local = e.param.numel()
            device = e.master.device
            position = 0
            while position < local:
                hi = min(local, position + _block_span(e.start + position))
                total = torch.zeros(hi - position, dtype=torch.float32, device=device)
                for member, coef in pairs:
                    for lo2, hi2, eps in noise.pieces(member.seed, e.name, e.numel, e.start + position,
                                                      e.start + hi, device=device):
                        total[lo2:hi2].add_(eps, alpha=coef)
                yield e, position, hi, total
                position = hi

    def es_update_(
        self, noise: NoiseSource, members: Sequence[Member], coefficients: Sequence[float], learning_rate: float
    ) -> None:
        """Apply ``theta <- theta + alpha / N * sum_i z_i * eps_i`` to the master in fp32, then render it.

        Source: Qiu et al. 2025 (arXiv 2509.24372), Algorithm 1 (the noise scale sigma is folded into ``alpha``).
        For antithetic pairs, ``eps_i = sign_i * eps(seed_i)``.

        Args:
            noise (`NoiseSource`): The noise source used for the perturbations.
            members (`Sequence[Member]`): The ``N`` members.
            coefficients (`Sequence[float]`): The shaped fitness ``z_i``, one per member.
            learning_rate (`float`): ``alpha``.
        """
        step = float(learning_rate) / len(members)
        with torch.no_grad():
            for e, lo, hi, total in self.noise_sum(noise, members, coefficients):
                flat = e.master.view(-1)[lo:hi]
                if flat.dtype == torch.float32:
                    flat.add_(total, alpha=step)
                else:
                    flat.copy_(flat.float().add_(total, alpha=step))
        self.render_()

    def es_gradient_(self, noise: NoiseSource, members: Sequence[Member], coefficients: Sequence[float]) -> None:
        """Store ``-(1 / N) * sum_i z_i * eps_i`` in ``master.grad`` (fp32), for a torch optimizer to descend.

        This is the ES gradient estimate of Salimans et al. 2017 (Eq. 2) in the scaling of Qiu et al. 2025
        (sigma folded into the learning rate), negated because torch optimizers minimize: plain SGD with
        ``lr = alpha`` then reproduces :meth:`es_update_`. Masters must be fp32.
        """
        scale = -1.0 / len(members)
        for e in self.entries:
            if e.master.dtype != torch.float32:
                raise ValueError("es_optimizer='torch' needs an fp32 master copy (fp32_master_weights=True).")
            e.master.grad = torch.zeros_like(e.master)
        for e, lo, hi, total in self.noise_sum(noise, members, coefficients):
            e.master.grad.view(-1)[lo:hi].add_(total, alpha=scale)

    def master_parameters(self) -> list[torch.Tensor]:
        """The master tensors as leaf tensors an optimizer can own (``requires_grad`` is not needed)."""
        return [e.master for e in self.entries]

    # ------------------------------------------------------------------ AWD
    def anchored_weight_decay_(self, anchor: dict[str, torch.Tensor], shrink: float, penalty: str = "l2") -> None:
        """Anchored Weight Decay (arXiv 2605.30148, Algorithm 1) on the master, in fp32, then render.

        With ``delta = theta - theta_0``: ``"l2"``: ``delta <- (1 - alpha * lambda) * delta``;
        ``"l1"``: ``delta <- sign(delta) * max(|delta| - alpha * lambda, 0)`` (soft threshold). Then
        ``theta = theta_0 + delta``.

        Args:
            anchor (`dict[str, torch.Tensor]`): ``theta_0`` by name (the local partition; any device).
            shrink (`float`): ``alpha * lambda``; must be in ``[0, 1)`` for ``"l2"``.
            penalty (`str`): ``"l2"`` or ``"l1"``.

        Raises:
            ValueError: for an unknown penalty or ``shrink >= 1`` with ``"l2"``.
        """
        if penalty not in AWD_PENALTIES:
            raise ValueError(f"awd_penalty must be one of {AWD_PENALTIES}, got {penalty!r}.")
        if penalty == "l2" and not 0 <= shrink < 1:
            raise ValueError(f"AWD with the l2 penalty needs 0 <= learning_rate * awd_lambda < 1, got {shrink}.")
        with torch.no_grad():
            for e in self.entries:
                theta0 = anchor[e.name].to(device=e.master.device, dtype=torch.float32).view_as(e.master)
                delta = e.master.float() - theta0
                if penalty == "l2":
                    delta.mul_(1.0 - shrink)
                else:
                    delta = torch.sign(delta) * torch.clamp(delta.abs() - shrink, min=0.0)
                e.master.copy_(theta0 + delta)
        self.render_()


def _block_span(position: int) -> int:
    """Elements from ``position`` to the end of its noise block (sums are formed per noise block)."""
    return NOISE_BLOCK_SIZE - position % NOISE_BLOCK_SIZE
