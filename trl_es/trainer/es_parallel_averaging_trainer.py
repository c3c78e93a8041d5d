"""ESParallelAveragingTrainer: ESTrainer, with an SFT update averaged into every ES iteration."""

from __future__ import annotations

import os

import torch

from .es_parallel_averaging_config import ESParallelAveragingConfig
from .es_trainer import ESTrainer
from .sft_step import SFT_STATE_NAME, SFTStep, sft_config_from

__all__ = ["ESParallelAveragingTrainer"]


class ESParallelAveragingTrainer(ESTrainer):
    r"""ES and SFT updates averaged in parallel at every ES iteration: the rule of *RL Excursions during Pre-Training*
    (arXiv 2606.04272) with ES (Qiu et al. 2025, arXiv 2509.24372) in place of the RL update:

    .. math::
        \theta \leftarrow \underbrace{\bar\theta + w_{\mathrm{ES}}\,\Delta_{\mathrm{ES}}}_{\theta_{\mathrm{ES}}}
        + w_{\mathrm{SFT}}\,(\theta_{\mathrm{SFT}} - \bar\theta).

    Each iteration scores the population exactly as ``ESTrainer`` does; then ``_es_step``

    1. snapshots the fp32 master :math:`\bar\theta`;
    2. applies the ES step through ``ESTrainer._es_step`` with the learning rate :math:`w_{\mathrm{ES}}\alpha`
       (so :math:`\theta_{\mathrm{ES}}` is bitwise what :func:`trl_es.replay` computes from the seed log record, which
       stores :math:`w_{\mathrm{ES}}\alpha` as the learning rate; AWD, if on, is part of this step);
    3. restores :math:`\bar\theta` and takes one SFT step from it (:class:`~trl_es.trainer.sft_step.SFTStep`:
       ``trl.SFTTrainer``'s data processing and loss, and a separate torch optimizer, AdamW by default, that owns the
       fp32 masters and receives the model's gradients), giving :math:`\theta_{\mathrm{SFT}}`;
    4. writes :math:`\theta_{\mathrm{ES}} + w_{\mathrm{SFT}}\,(\theta_{\mathrm{SFT}} - \bar\theta)` (float32, in that
       order) into the master and renders it into the model.

    The SFT step trains the parameters ES trains (``include_parameters`` / ``exclude_parameters``).

    **Replay.** The seed log holds the ES part only: :func:`trl_es.replay` rebuilds the run bitwise only when
    ``sft_weight == 0``. Otherwise the SFT deltas are needed too, and they are as large as the trained parameters
    (one fp32 copy of them per iteration: about 540 MB per iteration for SmolLM2-135M), so they are not saved: a
    checkpoint (the model, the master, ``sft_optimizer.pt``) is how to resume.

    Logged per iteration, besides ``ESTrainer``'s metrics: ``sft/loss``, ``sft/grad_norm``, ``sft/learning_rate``,
    ``sft/mean_token_accuracy``, ``sft/entropy``, ``update_norm/es`` and ``update_norm/sft``
    (:math:`\|w_{\mathrm{ES}}\Delta_{\mathrm{ES}}\|_2` and :math:`\|\Delta_{\mathrm{SFT}}\|_2`).

    One process only (no population parallelism, no DeepSpeed): every process would have to take the same SFT step.

    Args:
        model (`str` or `PreTrainedModel`): As :class:`ESTrainer`.
        reward_funcs (`Callable | list`): As :class:`ESTrainer`.
        args (`ESParallelAveragingConfig`, *optional*): ESConfig's fields plus the averaging and ``sft_*`` fields.
        train_dataset (`datasets.Dataset`): The ES prompts, as :class:`ESTrainer`.
        sft_dataset (`datasets.Dataset`): The SFT data, in a format ``trl.SFTTrainer`` accepts.
        eval_dataset (`datasets.Dataset`, *optional*): As :class:`ESTrainer`.
        processing_class (`PreTrainedTokenizerBase`, *optional*): As :class:`ESTrainer`; the SFT side uses it too.
        reward_processing_classes (*optional*): As :class:`ESTrainer`.
        callbacks (`list[TrainerCallback]`, *optional*): As :class:`ESTrainer`.
        optimizers (`tuple`, *optional*): As :class:`ESTrainer`.
        peft_config (`peft.PeftConfig`, *optional*): As :class:`ESTrainer`.

    Raises:
        ValueError: without ``sft_dataset``, with several processes or under DeepSpeed.
        TypeError: if ``args`` is not an :class:`ESParallelAveragingConfig`.
    """

    _tag_names = ["trl", "trl-es", "evolution-strategies", "sft", "parallel-averaging"]
    _name = "Parallel averaging (ES + SFT)"

    def __init__(
        self,
        model,
        reward_funcs,
        args: ESParallelAveragingConfig | None = None,
        train_dataset=None,
        sft_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
    ):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = ESParallelAveragingConfig(f"{name.split('/')[-1]}-ES-SFT")
        if not isinstance(args, ESParallelAveragingConfig):
            raise TypeError(f"args must be an ESParallelAveragingConfig, got {type(args).__name__}.")
        if sft_dataset is None:
            raise ValueError("ESParallelAveragingTrainer needs an sft_dataset (the SFT side's data).")
        super().__init__(
            model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class, reward_processing_classes=reward_processing_classes,
            callbacks=callbacks, optimizers=optimizers, peft_config=peft_config,
        )
        if self.accelerator.num_processes > 1 or self.is_deepspeed_enabled:
            raise ValueError("ESParallelAveragingTrainer runs in one process, without DeepSpeed: every process would "
                             "have to take the same SFT step.")
        sft_args = sft_config_from(
            args,
            learning_rate=args.sft_learning_rate,
            per_device_train_batch_size=args.sft_per_device_train_batch_size,
            max_length=args.sft_max_length,
            completion_only_loss=args.sft_completion_only_loss,
            max_grad_norm=args.sft_max_grad_norm,
        )
        self.sft_step = SFTStep(self.accelerator.unwrap_model(self.model), self.processing_class, sft_dataset,
                                sft_args, targets=self._sft_targets())
        if args.sft_weight != 0:  # the seed log holds the ES share only: say so, so that replay refuses it
            self.seed_log.header["not_replayable"] = (
                f"ES + SFT parallel averaging with sft_weight={args.sft_weight}: the seed log holds only the ES share "
                "of each update; the SFT deltas are not saved."
            )

    def _sft_targets(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, fp32 master) of every ES-trained tensor: the SFT gradient of the parameter goes to the
        master, which the SFT optimizer owns."""
        return list(zip(self._es_model_params, self.es_params.master_parameters()))

    def _es_step(self, members, coefficients: list[float], learning_rate: float) -> tuple[float, float]:
        """The ES share (``ESTrainer._es_step`` at ``es_weight * learning_rate``), then the SFT step from the same
        snapshot, then the average; returns what the seed log records (the ES share's learning rate and AWD shrink).
        """
        args = self.args
        masters = self.es_params.master_parameters()
        with torch.no_grad():
            theta_bar = [m.detach().clone() for m in masters]
        recorded = super()._es_step(members, coefficients, args.es_weight * learning_rate)
        with torch.no_grad():
            theta_es = [m.detach().clone() for m in masters]
            for m, bar in zip(masters, theta_bar):
                m.copy_(bar)
        self.es_params.render_()
        self.sft_step.create_scheduler(self.state.max_steps)
        self.sft_step.targets = self._sft_targets()
        sft_metrics = self.sft_step.step(self.state.global_step)
        with torch.no_grad():
            es_norm = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(e - b, dtype=torch.float64) for e, b in zip(theta_es, theta_bar)]))
            sft_norm = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(m - b, dtype=torch.float64) for m, b in zip(masters, theta_bar)]))
            for m, bar, es in zip(masters, theta_bar, theta_es):
                m.copy_(es + args.sft_weight * (m - bar))
        self.es_params.render_()
        for key in ("loss", "grad_norm", "learning_rate", "mean_token_accuracy", "entropy"):
            if key in sft_metrics:
                self._metrics[f"sft/{key}"].append(sft_metrics[key])
        self._metrics["update_norm/es"].append(float(es_norm))
        self._metrics["update_norm/sft"].append(float(sft_norm))
        return recorded

    # ------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save and self.sft_step.lr_scheduler is not None:
            self.sft_step.save(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, SFT_STATE_NAME)
        if not os.path.isfile(path):
            raise ValueError(f"Cannot resume ESParallelAveragingTrainer from {checkpoint!r}: no {SFT_STATE_NAME}.")
        self.sft_step.create_scheduler(self.state.max_steps)
        self.sft_step.load_state_dict(torch.load(path, weights_only=True))
