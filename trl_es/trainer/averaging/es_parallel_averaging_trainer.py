"""ESParallelAveragingTrainer: ESTrainer, with an SFT update averaged into every ES iteration."""

from __future__ import annotations

import torch

from ..es.es_trainer import ESTrainer
from .es_parallel_averaging_config import ESParallelAveragingConfig
from .sft_averaging import SFTAveragingTrainerMixin, restore_snapshot, snapshot


__all__ = ["ESParallelAveragingTrainer"]


class ESParallelAveragingTrainer(SFTAveragingTrainerMixin, ESTrainer):
    r"""ES and SFT updates averaged in parallel at every ES iteration: the rule of *RL Excursions during Pre-Training*
    (arXiv 2606.04272) with ES (Qiu et al. 2025, arXiv 2509.24372) in place of the RL update:

    .. math::
        \theta \leftarrow \underbrace{\bar\theta + w_{\mathrm{ES}}\,\Delta_{\mathrm{ES}}}_{\theta_{\mathrm{ES}}}
        + w_{\mathrm{SFT}}\,(\theta_{\mathrm{SFT}} - \bar\theta).

    Each iteration scores the population exactly as ``ESTrainer`` does; then ``_tell``

    1. snapshots the fp32 master :math:`\bar\theta`;
    2. applies the ES step through ``ESTrainer._tell`` with the learning rate :math:`w_{\mathrm{ES}}\alpha`
       (so :math:`\theta_{\mathrm{ES}}` is bitwise what :func:`trl_es.replay` computes from the seed log record, which
       stores :math:`w_{\mathrm{ES}}\alpha` as the learning rate; AWD, if on, is part of this step);
    3. restores :math:`\bar\theta` and takes one SFT step from it (:class:`~trl_es.trainer.averaging.sft_step.SFTStep`:
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

    _averaging_config_class = ESParallelAveragingConfig
    _averaging_output_suffix = "-ES-SFT"
    _averaging_update = "es"

    def _check_one_process(self) -> None:
        if self.accelerator.num_processes > 1 or self.is_deepspeed_enabled:
            raise ValueError("ESParallelAveragingTrainer runs in one process, without DeepSpeed: every process would "
                             "have to take the same SFT step.")

    def _train_metrics(self):
        return self._metrics

    def _start_averaging(self) -> None:
        if self.args.sft_weight != 0:  # the seed log holds the ES share only: say so, so that replay refuses it
            self.seed_log.header["not_replayable"] = (
                f"ES + SFT parallel averaging with sft_weight={self.args.sft_weight}: the seed log holds only the ES "
                "share of each update; the SFT deltas are not saved."
            )

    def _sft_targets(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, fp32 master) of every ES-trained tensor: the SFT gradient of the parameter goes to the
        master, which the SFT optimizer owns."""
        return list(zip(self._es_model_params, self.es_params.master_parameters(), strict=False))

    def _tell(self, members, fitness: torch.Tensor, learning_rate: float):
        """The ES share (``ESTrainer._tell`` at ``es_weight * learning_rate``), then the SFT step from the same
        snapshot, then the average; returns the ES share's ``Told`` (what the seed log records: its coefficients,
        learning rate and AWD shrink).
        """
        args = self.args
        masters = self.es_params.master_parameters()
        theta_bar = snapshot(masters)
        told = super()._tell(members, fitness, args.es_weight * learning_rate)
        theta_es = restore_snapshot(masters, theta_bar)
        self.es_params.render_()
        self.sft_step.create_scheduler(self.state.max_steps)
        self.sft_step.targets = self._sft_targets()
        self._sft_step_and_log(theta_es, masters, theta_bar, float32=False)
        with torch.no_grad():
            for m, bar, es in zip(masters, theta_bar, theta_es, strict=True):
                m.copy_(es + args.sft_weight * (m - bar))
        self.es_params.render_()
        return told
