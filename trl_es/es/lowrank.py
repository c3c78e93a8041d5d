"""Batched low-rank populations: many ES members in one ``generate`` call (EGGROLL).

Source: Sarkar et al. 2025, "Evolution Strategies at the Hyperscale" (EGGROLL, arXiv 2511.16652). Each member
perturbs every targeted weight matrix ``W`` (``out x in``) of an ``nn.Linear`` by a rank-``r`` matrix

    E_i = sign_i * (sigma / sqrt(r)) * A_i @ B_i^T,      A_i: (out, r),  B_i: (in, r),  entries i.i.d. N(0, 1),

so each element of ``A_i B_i^T / sqrt(r)`` has unit variance, as the full-rank noise ``eps_i`` has. The weights are
never written: during one batched ``generate`` over the prompt batch repeated once per member, each targeted
Linear computes, for the rows of member ``i``,

    y = x W^T + (sign_i * sigma / sqrt(r)) * (x B_i) A_i^T,

which costs ``O(r (in + out))`` per row on top of the shared ``x W^T`` (two batched matmuls per Linear call, no
Python loop over members). The update is the ES step with these perturbations, sigma folded into the learning
rate as in the full-rank path (Qiu et al. 2025, arXiv 2509.24372, Algorithm 1):

    W <- W + (alpha / N) * sum_i z_i * sign_i * A_i B_i^T / sqrt(r).

Each member's rank-``r`` perturbation is low-rank, but the sum over ``N`` members has rank up to ``N r``.

``A_i`` and ``B_i`` come from the seeded, partition-invariant noise source (:mod:`trl_es.es.noise`) under the
tensor names ``name + ".lowrank_A"`` and ``name + ".lowrank_B"`` (row-major ``(out, r)`` and ``(in, r)``), so the
seed log (member seeds, signs, coefficients) and ``noise_rank`` reproduce every update bitwise in
:func:`trl_es.replay`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from .noise import NoiseSource, full_noise
from .population import PopulationBackend
from .update import Member, TrainedParameters

LOWRANK_A_SUFFIX = ".lowrank_A"
LOWRANK_B_SUFFIX = ".lowrank_B"

_SELECT_HINT = (
    "population_backend='batched_lowrank' perturbs and trains only the 2-D weights of nn.Linear modules. Select "
    "them with include_parameters, e.g. include_parameters=r'proj\\.weight$' for Llama/Qwen/SmolLM attention and "
    "MLP projections (norms, biases, embeddings and an lm_head tied to the embeddings are not supported)."
)


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


class BatchedLowRankPopulation(PopulationBackend):
    """Evaluate many members in one batched ``generate`` with per-row low-rank perturbations (EGGROLL).

    Member ``i`` perturbs every trained weight ``W`` (``out x in``) by ``E_i = sign_i (sigma/sqrt(r)) A_i B_i^T``
    (Sarkar et al. 2025, arXiv 2511.16652). :meth:`evaluate` installs a forward hook on each targeted
    ``nn.Linear`` that adds ``(sign_i sigma / sqrt(r)) (x B_i) A_i^T`` to the rows of member ``i``, calls
    ``rollout.stacked(chunk)`` once per chunk of members, and removes the hooks in a ``finally`` block (an
    exception, ``KeyboardInterrupt`` included, leaves no hook behind). The weights are never modified.

    Row map: in ``rollout.stacked(indices)`` member ``indices[k]`` owns the rows ``[k n, (k + 1) n)`` of every
    batch. ``n`` is inferred at call time as ``batch_size // len(indices)``; batch rows keep their position during
    ``generate`` (greedy or sampling, with or without KV cache), so the map holds at every decoding step. A Linear
    input of shape ``(batch, ..., in)`` is viewed as ``(members, n * ..., in)``: one ``bmm`` and one ``baddbmm``
    per call, no Python loop over members; under ``no_grad`` (as in ``generate``) the ``baddbmm`` adds into the
    Linear's output in place.

    Model lookup: the hooks need the modules, which ``params`` does not hold. :meth:`evaluate` uses
    ``rollout.model`` (set by :class:`~trl_es.ESTrainer`), else the model given to :meth:`bind`. A trained entry is
    a target when its tensor (same ``data_ptr`` and shape) is the ``weight`` of one or more ``nn.Linear`` modules
    and of nothing else.

    Frozen / unsupported parameters: this backend **raises** ``ValueError`` (at the first :meth:`evaluate`) if the
    trained parameters include anything else (norm weights, biases, embeddings, an ``lm_head`` tied to the
    embeddings, a ZeRO-3 partition). Select the Linear weights with ``ESConfig.include_parameters`` (e.g.
    ``r"proj\\.weight$"``); everything not selected stays frozen. :meth:`update_` (used by ``replay``, which has no
    model) treats every trained tensor as a 2-D ``(out, in)`` weight and raises for any other tensor.

    Args:
        noise_rank (`int`): ``r >= 1``, the rank of each member's perturbation of each weight.
        member_chunk_size (`int` or `None`): Members per ``generate`` call (``None``: all members of this process
            in one call). The batch is ``member_chunk_size * len(prompts) * num_generations`` rows; lower it to bound
            activation and KV-cache memory.

    Raises:
        ValueError: if ``noise_rank < 1`` or ``member_chunk_size < 1``.
    """

    name = "batched_lowrank"

    def __init__(self, noise_rank: int = 1, member_chunk_size: int | None = None):
        super().__init__()
        if int(noise_rank) != noise_rank or noise_rank < 1:
            raise ValueError(f"noise_rank must be an integer >= 1, got {noise_rank!r}.")
        if member_chunk_size is not None and member_chunk_size < 1:
            raise ValueError(f"member_chunk_size must be None or >= 1, got {member_chunk_size!r}.")
        self.noise_rank = int(noise_rank)
        self.member_chunk_size = member_chunk_size
        self._model: nn.Module | None = None

    def describe(self) -> dict:
        """``{"name": "batched_lowrank", "noise_rank": r}``: what ``replay`` needs to rebuild :meth:`update_`."""
        return {"name": self.name, "noise_rank": self.noise_rank}

    def bind(self, model: nn.Module) -> BatchedLowRankPopulation:
        """Use ``model`` to find the Linear modules when a rollout has no ``.model`` attribute. Returns ``self``."""
        self._model = model
        return self

    # ------------------------------------------------------------------ targets
    def targets(self, model: nn.Module, params: TrainedParameters) -> list[tuple[object, list[nn.Linear]]]:
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
            raise ValueError(f"Cannot perturb {bad[:5]}{more} with low-rank noise. {_SELECT_HINT}")
        return matched

    # ------------------------------------------------------------------ evaluation
    def _member_factors(self, noise, members, entry, sigma, device, dtype):
        """Stacked factors of ``members`` for one weight: ``B`` (M, in, r) and scaled ``A^T`` (M, r, out)."""
        out_features, in_features = entry.param.shape
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        bs, ats = [], []
        for member in members:
            if member.seed not in cache:  # antithetic pairs share their factors
                cache[member.seed] = lowrank_factors(noise, member.seed, entry.name, out_features, in_features,
                                                     self.noise_rank, device)
            a, b = cache[member.seed]
            bs.append(b)
            ats.append(a.T * (member.sign * float(sigma) / math.sqrt(self.noise_rank)))
        return torch.stack(bs).to(dtype), torch.stack(ats).to(dtype)

    def _install(self, model, params, noise, members, sigma) -> list:
        """Register the hooks of :meth:`perturbed`; returns their handles (none stay registered if this raises)."""
        handles = []
        try:
            for entry, modules in self.targets(model, params):
                b_stack, at_stack = self._member_factors(noise, members, entry, sigma, entry.param.device,
                                                         entry.param.dtype)
                hook = _make_hook(b_stack, at_stack, len(members), entry.name)
                for module in modules:
                    handles.append(module.register_forward_hook(hook, with_kwargs=True))
        except BaseException:
            _remove(handles)
            raise
        return handles

    @contextlib.contextmanager
    def perturbed(
        self, model: nn.Module, params: TrainedParameters, noise: NoiseSource, members: Sequence[Member], sigma: float
    ) -> Iterator[None]:
        """Context in which row block ``k`` of every forward of ``model`` sees ``W + E_{members[k]}``.

        The batch (first) dimension ``b`` of each targeted Linear's input must be a multiple of ``M = len(members)``;
        block ``k`` is rows ``[k b / M, (k + 1) b / M)``. The hooks are removed on exit, also on an exception.

        Args:
            model (`nn.Module`): The model holding ``params``.
            params (`TrainedParameters`): The trained parameters (all must be Linear weights, see :meth:`targets`).
            noise (`NoiseSource`): The noise source.
            members (`Sequence[Member]`): The ``M`` members, in row-block order.
            sigma (`float`): Noise scale.

        Raises:
            ValueError: see :meth:`targets`; at forward time, if the batch size is not a multiple of ``M``.
        """
        handles = self._install(model, params, noise, members, sigma)
        try:
            yield
        finally:
            _remove(handles)

    def evaluate(self, params, noise, members, indices, sigma, rollout):
        """Score members ``indices`` with ``rollout.stacked``, ``member_chunk_size`` members per call (see class doc).

        ``timings["perturb"]`` is the time spent building factors and installing hooks, ``timings["restore"]`` the
        time spent removing them.

        Raises:
            ValueError: if no model is found (neither ``rollout.model`` nor :meth:`bind`), if ``rollout`` has no
                ``stacked`` method, or if the trained parameters are not all Linear weights (see :meth:`targets`).
        """
        self.timings = {"perturb": 0.0, "restore": 0.0}
        model = getattr(rollout, "model", None)
        model = self._model if model is None else model
        if model is None:
            raise ValueError("BatchedLowRankPopulation needs the model: pass a rollout with a `.model` attribute "
                             "(ESTrainer does) or call backend.bind(model) first.")
        if not hasattr(rollout, "stacked"):
            raise ValueError("BatchedLowRankPopulation needs rollout.stacked(indices) (one generate for many members).")
        indices = list(indices)
        chunk = self.member_chunk_size or max(1, len(indices))
        fitness: dict[int, float] = {}
        for lo in range(0, len(indices), chunk):
            part = indices[lo : lo + chunk]
            handles = []
            try:
                start = time.perf_counter()
                handles = self._install(model, params, noise, [members[i] for i in part], sigma)
                self.timings["perturb"] += time.perf_counter() - start
                fitness.update(rollout.stacked(part))
            finally:
                start = time.perf_counter()
                _remove(handles)
                self.timings["restore"] += time.perf_counter() - start
        return fitness

    # ------------------------------------------------------------------ the ES step
    def _update_sums(self, params: TrainedParameters, noise: NoiseSource, members, coefficients):
        """Yield ``(entry, total)`` with ``total = sum_i z_i sign_i A_i B_i^T / sqrt(r)`` (fp32), one weight at a time.

        Summed as rank-1 terms in a fixed order (members in population order, then rank index), with elementwise
        fp32 operations only (no matmul reduction), so the trainer and ``replay`` get bitwise equal sums.
        """
        pairs = [(m, float(c) * m.sign / math.sqrt(self.noise_rank))
                 for m, c in zip(members, coefficients, strict=True) if float(c) != 0.0]
        for e in params.entries:  # all checked before any weight moves
            if e.param.dim() != 2 or e.start != 0 or e.param.numel() != e.numel:
                raise ValueError(f"Cannot apply a low-rank update to {e.name!r} (shape {tuple(e.param.shape)}). "
                                 f"{_SELECT_HINT}")
        for e in params.entries:
            out_features, in_features = e.param.shape
            device = e.master.device
            total = torch.zeros(out_features, in_features, dtype=torch.float32, device=device)
            for member, coef in pairs:
                a, b = lowrank_factors(noise, member.seed, e.name, out_features, in_features, self.noise_rank, device)
                a = a * coef
                for j in range(self.noise_rank):
                    total.addcmul_(a[:, j : j + 1], b[:, j].unsqueeze(0))
            yield e, total

    def update_(self, params, noise, members, coefficients, learning_rate) -> None:
        """``W <- W + (alpha / N) sum_i z_i sign_i A_i B_i^T / sqrt(r)`` in fp32 into the master, then render.

        Sigma is folded into ``alpha`` as in :meth:`TrainedParameters.es_update_` (Qiu et al. 2025, Algorithm 1).
        Streamed one weight matrix at a time: extra memory is one fp32 matrix plus the factors.

        Args:
            params (`TrainedParameters`): The trained parameters (2-D weights only).
            noise (`NoiseSource`): The noise source used for the perturbations.
            members (`Sequence[Member]`): The ``N`` members.
            coefficients (`Sequence[float]`): The shaped fitness ``z_i``, one per member.
            learning_rate (`float`): ``alpha``.

        Raises:
            ValueError: if a trained tensor is not a whole 2-D matrix.
        """
        step = float(learning_rate) / len(members)
        with torch.no_grad():
            for e, total in self._update_sums(params, noise, members, coefficients):
                if e.master.dtype == torch.float32:
                    e.master.add_(total, alpha=step)
                else:
                    e.master.copy_(e.master.float().add_(total, alpha=step))
        params.render_()

    def gradient_(self, params, noise, members, coefficients) -> None:
        """Store ``-(1/N) sum_i z_i sign_i A_i B_i^T / sqrt(r)`` in ``master.grad`` (fp32) for a torch optimizer.

        Plain SGD with ``lr = alpha`` then reproduces :meth:`update_`.

        Raises:
            ValueError: if a master is not fp32 or a trained tensor is not a whole 2-D matrix.
        """
        scale = -1.0 / len(members)
        for e in params.entries:
            if e.master.dtype != torch.float32:
                raise ValueError("es_optimizer='torch' needs an fp32 master copy (fp32_master_weights=True).")
        for e, total in self._update_sums(params, noise, members, coefficients):
            e.master.grad = total.mul_(scale)


def _remove(handles) -> None:
    for handle in handles:
        handle.remove()


def _make_hook(b_stack: torch.Tensor, at_stack: torch.Tensor, count: int, name: str):
    """A forward hook adding ``(x B_k) (s_k A_k^T)`` to the rows of block ``k`` of a Linear's output.

    Args:
        b_stack (`torch.Tensor`): ``(M, in, r)``, the ``B`` factors.
        at_stack (`torch.Tensor`): ``(M, r, out)``, the ``A^T`` factors scaled by ``sign * sigma / sqrt(r)``.
        count (`int`): ``M``.
        name (`str`): Parameter name, for error messages.
    """

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["input"]
        batch = x.shape[0]
        if batch % count:
            raise ValueError(f"Batched low-rank population: the input of {name!r} has batch size {batch}, not a "
                             f"multiple of the {count} stacked members.")
        x = x.reshape(count, -1, x.shape[-1])
        if x.dtype != b_stack.dtype:
            x = x.to(b_stack.dtype)
        low = torch.bmm(x, b_stack).to(output.dtype)  # (M, rows * tokens, r)
        if output.is_contiguous() and not (output.requires_grad and torch.is_grad_enabled()):
            # in place (generate runs under no_grad): no new activation-sized tensor, one pass over the output
            output.view(count, -1, output.shape[-1]).baddbmm_(low, at_stack.to(output.dtype))
            return output
        flat = output.reshape(count, -1, output.shape[-1])
        return torch.baddbmm(flat, low, at_stack.to(output.dtype)).view(output.shape)

    return hook
