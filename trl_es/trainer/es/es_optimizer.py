"""ESTrainer's optimizer hooks: the Trainer's optimizer owns the fp32 master tensors (``es_optimizer="torch"``),
the ES gradient is clipped within the iteration, and ``Trainer``'s own clip and norm read what the iteration did.

A mixin of :class:`~trl_es.trainer.es.es_trainer.ESTrainer` (it reads ``args``, ``es_params``, ``sharded``,
``accelerator``, ``optimizer`` and ``_es_grad_norm``).
"""

from __future__ import annotations

import torch


class ESOptimizerMixin:
    """The optimizer side of :class:`~trl_es.trainer.es.es_trainer.ESTrainer` (see ``_es_step`` there)."""

    def create_optimizer(self, model=None):
        """The Trainer's optimizer class and kwargs, owning the fp32 master tensors (not the 16-bit parameters).

        With ``es_optimizer='es'`` it never receives a gradient, so ``step()`` is a no-op and allocates no state.
        """
        if self.optimizer is None:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
            groups = [{"params": self.es_params.master_parameters(), "weight_decay": self.args.weight_decay}]
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    def _clip_es_gradient(self) -> torch.Tensor:
        """Clip the ES gradient estimate in ``master.grad`` to ``max_grad_norm`` (when ``> 0``) and return its norm
        (before clipping, as ``Trainer`` logs it)."""
        masters = self.es_params.master_parameters()
        if self.args.max_grad_norm <= 0:
            return torch.nn.utils.get_total_norm([m.grad for m in masters if m.grad is not None])
        if not (self.sharded and self.accelerator.num_processes > 1):
            return torch.nn.utils.clip_grad_norm_(masters, self.args.max_grad_norm)
        # ZeRO-3: the masters are partitions; the norm is over the whole gradient estimate.
        grads = [m.grad for m in masters if m.grad is not None]
        square = torch.stack([g.double().pow(2).sum() for g in grads]).sum() if grads else torch.zeros((), dtype=torch.float64)
        square = self.accelerator.reduce(square.reshape(1).to(self.accelerator.device), reduction="sum").cpu()
        total = square.sqrt()[0]
        torch.nn.utils.clip_grads_with_norm_(masters, self.args.max_grad_norm, total)
        return total

    def _clip_grad_norm(self, model):
        # The ES gradient was clipped and stepped within the iteration (see _es_step): Trainer's clip is a no-op.
        # (es_optimizer="es" has no gradient: its norm is 0, as torch's clip of no gradient says.)
        return self._es_grad_norm if self._es_grad_norm is not None else torch.zeros(())

    def _get_grad_norm(self, model, grad_norm=None):
        norm = grad_norm if grad_norm is not None else self._es_grad_norm
        return norm.item() if hasattr(norm, "item") else norm

    def _current_learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else self.args.learning_rate
