"""What the GRPO + SFT and ES + SFT parallel-averaging trainers share: the ``sft_*`` config fields
(:class:`SFTAveragingFields`) and the trainer side (:class:`SFTAveragingTrainerMixin`: construction, the SFT step with
its metrics, its checkpoint state). Each trainer keeps its own rule of when the SFT step happens and how to average.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, make_dataclass

import torch
from trl import SFTConfig

from .sft_step import SFT_STATE_NAME, SFTStep, sft_config_from


__all__ = ["SFT_METRICS", "SFTAveragingFields", "SFTAveragingTrainerMixin", "restore_snapshot", "snapshot",
           "update_norm", "update_weight_field"]

#: The SFT step's metrics that are logged, as ``sft/<name>``, when the step reports them.
SFT_METRICS = ("loss", "grad_norm", "learning_rate", "mean_token_accuracy", "entropy")


@dataclass
class SFTAveragingFields:
    """The SFT side's fields of a parallel-averaging config (a mixin listed before the host config class), checked by
    :func:`~trl_es.trainer.averaging.sft_step.check_averaging_fields`; the defaults are GRPO + SFT's."""

    #: ``sft_<name>`` fields that take the host config's ``<name>`` when they are ``None`` (a class attribute).
    _sft_host_defaults = ("learning_rate", "max_grad_norm")

    sft_weight: float = field(
        default=0.5,
        metadata={"help": "w_SFT, the weight of the SFT update Delta_SFT. Default 1/2 (arXiv 2606.04272)."},
    )
    sft_learning_rate: float | None = field(
        default=None,
        metadata={"help": "Learning rate of the SFT optimizer. Default None: learning_rate (the RL side's)."},
    )
    sft_per_device_train_batch_size: int = field(
        default=8, metadata={"help": "SFT examples (prompt + target completion) per step. Ours."}
    )
    sft_max_length: int | None = field(
        default=1024,
        metadata={"help": "Tokens per SFT example (prompt + completion), truncated beyond; None = no truncation. "
                  "Default 1024, SFTConfig's."},
    )
    sft_completion_only_loss: bool | None = field(
        default=None,
        metadata={"help": "SFT loss on completion tokens only. None (default): SFTTrainer's default, True for "
                  "prompt-completion data."},
    )
    sft_max_grad_norm: float | None = field(
        default=None,
        metadata={"help": "Clip the SFT gradient to this norm (0 = no clipping). Default None: max_grad_norm."},
    )

    def sft_config(self) -> SFTConfig:
        """The SFT side's ``trl.SFTConfig`` (:func:`~trl_es.trainer.averaging.sft_step.sft_config_from`)."""

        def value(name: str):  # the host's field for a None named in _sft_host_defaults
            own = getattr(self, f"sft_{name}")
            return getattr(self, name) if own is None and name in self._sft_host_defaults else own

        return sft_config_from(
            self,
            learning_rate=value("learning_rate"),
            per_device_train_batch_size=self.sft_per_device_train_batch_size,
            max_length=self.sft_max_length,
            completion_only_loss=self.sft_completion_only_loss,
            max_grad_norm=value("max_grad_norm"),
        )


def update_weight_field(name: str, help_text: str) -> type:
    """A dataclass base holding the one field ``name: float = 0.5`` (``help_text`` its help), the weight of the host's
    own update (``rl_weight``, ``es_weight``)."""
    # listed after SFTAveragingFields in the bases, it comes first in the constructor and in --help: w_RL, w_SFT
    return make_dataclass(f"{name}_field", [(name, float, field(default=0.5, metadata={"help": help_text}))])


@torch.no_grad()
def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    r"""Detached copies of ``tensors`` (e.g. :math:`\bar\theta` before an update)."""
    return [t.detach().clone() for t in tensors]


@torch.no_grad()
def restore_snapshot(tensors: list[torch.Tensor], theta_bar: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy ``theta_bar`` back into ``tensors``, in place; returns copies of what they held before."""
    updated = snapshot(tensors)  # the update just taken from theta_bar
    for t, bar in zip(tensors, theta_bar, strict=False):
        t.copy_(bar)
    return updated


@torch.no_grad()
def update_norm(after: list[torch.Tensor], before: list[torch.Tensor], *, float32: bool) -> float:
    r""":math:`\|\mathrm{after} - \mathrm{before}\|_2` over all tensors, accumulated in float64; the differences
    are taken in float32 if ``float32``, else in the tensors' dtype."""
    if float32:  # the differences of low-precision parameters taken in float32
        pairs = zip(after, before, strict=False)
        diffs = (torch.linalg.vector_norm(a.float() - b.float(), dtype=torch.float64) for a, b in pairs)
    else:
        diffs = (torch.linalg.vector_norm(a - b, dtype=torch.float64) for a, b in zip(after, before, strict=False))
    return float(torch.linalg.vector_norm(torch.stack(list(diffs))))


class SFTAveragingTrainerMixin:
    """The shared half of a parallel-averaging trainer, listed before its host (``GRPOTrainer`` or
    :class:`~trl_es.trainer.es.es_trainer.ESTrainer`), taking its constructor's arguments plus ``sft_dataset``.

    Attributes:
        sft_step (`SFTStep`): The SFT side (its own optimizer and scheduler), saved as ``sft_optimizer.pt``.

    Raises:
        TypeError: if ``args`` is not the trainer's config class.
        ValueError: without ``sft_dataset``, or where :meth:`_check_one_process` refuses.
    """

    # set by each trainer, with _check_one_process, _train_metrics, _start_averaging (and optionally _sft_targets);
    # its own update and the average stay with it, _sft_step_and_log runs between them
    _averaging_config_class: type
    _averaging_output_suffix: str  # of the default output_dir, after the model's name
    _averaging_update: str  # "rl" or "es": the update_norm/<name> log key

    def __init__(
        self,
        model,
        reward_funcs,
        args=None,
        train_dataset=None,
        sft_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
    ):
        config_class = self._averaging_config_class
        if args is None:  # as TRL's trainers: output_dir named after the model
            name = model if isinstance(model, str) else model.config._name_or_path
            args = config_class(f"{name.split('/')[-1]}{self._averaging_output_suffix}")
        if not isinstance(args, config_class):
            article = "an" if config_class.__name__[0] in "AEIOU" else "a"
            raise TypeError(f"args must be {article} {config_class.__name__}, got {type(args).__name__}.")
        if sft_dataset is None:
            raise ValueError(f"{self._averaging_name()} needs an sft_dataset (the SFT side's data).")
        super().__init__(
            model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class, reward_processing_classes=reward_processing_classes,
            callbacks=callbacks, optimizers=optimizers, peft_config=peft_config,
        )
        self._check_one_process()  # after the Trainer set up accelerate
        self.sft_step = SFTStep(self.accelerator.unwrap_model(self.model), self.processing_class, sft_dataset,
                                args.sft_config(), targets=self._sft_targets())
        self._start_averaging()

    @classmethod
    def _averaging_name(cls) -> str:
        """The name of the trainer that set ``_averaging_config_class`` (also in a subclass's messages)."""
        return next(c for c in cls.__mro__ if "_averaging_config_class" in vars(c)).__name__

    # ------------------------------------------------------------------ set by each trainer
    def _check_one_process(self) -> None:
        """Raise ``ValueError`` where the SFT step cannot run (several processes, DeepSpeed, ...)."""
        raise NotImplementedError

    def _train_metrics(self):
        """The host trainer's dict of training metrics (``name -> list``), averaged at each log."""
        raise NotImplementedError

    def _start_averaging(self) -> None:
        """The trainer's own set-up, once ``self.sft_step`` exists."""
        raise NotImplementedError

    def _sft_targets(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """``targets`` of the :class:`SFTStep` (``None``: the model's trainable parameters themselves)."""
        return None

    # ------------------------------------------------------------------ the SFT step
    def _sft_step_and_log(self, theta_other: list[torch.Tensor], tensors: list[torch.Tensor],
                          theta_bar: list[torch.Tensor], *, float32: bool) -> None:
        r"""Take SFT step ``global_step`` from ``tensors`` (holding :math:`\bar\theta`); log ``sft/*`` and the update
        norms (:func:`update_norm`) of ``theta_other`` and of the SFT step."""
        sft_metrics = self.sft_step.step(self.state.global_step)
        other_norm = update_norm(theta_other, theta_bar, float32=float32)  # update_norm/<update>
        sft_norm = update_norm(tensors, theta_bar, float32=float32)  # update_norm/sft
        metrics = self._train_metrics()
        for key in SFT_METRICS:
            if key in sft_metrics:
                metrics[f"sft/{key}"].append(sft_metrics[key])
        metrics[f"update_norm/{self._averaging_update}"].append(other_norm)
        metrics["update_norm/sft"].append(sft_norm)

    # ------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save and self.sft_step.lr_scheduler is not None:  # the one process that writes
            self.sft_step.save(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        if not os.path.isfile(os.path.join(checkpoint, SFT_STATE_NAME)):  # a fresh SFT optimizer would not be a resume
            raise ValueError(f"Cannot resume {self._averaging_name()} from {checkpoint!r}: no {SFT_STATE_NAME} (the "
                             "SFT optimizer's state).")
        self.sft_step.load(checkpoint, self.state.max_steps)
