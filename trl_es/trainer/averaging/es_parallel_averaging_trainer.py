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

    :math:`\theta_{\mathrm{ES}}` is the ES step at learning rate :math:`w_{\mathrm{ES}}\alpha` (AWD included);
    :math:`\theta_{\mathrm{SFT}}` one step of a separate optimizer (:class:`~trl_es.trainer.averaging.sft_step.SFTStep`)
    from :math:`\bar\theta` on the parameters ES trains. The seed log replays bitwise only when ``sft_weight == 0``.

    The arguments are :class:`ESTrainer`'s (``args``: an :class:`ESParallelAveragingConfig`), plus ``sft_dataset``:
    the SFT data, in a format ``trl.SFTTrainer`` accepts.

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
        # no population parallelism: every process would have to take the same SFT step
        if self.accelerator.num_processes > 1 or self.is_deepspeed_enabled:
            raise ValueError("ESParallelAveragingTrainer runs in one process, without DeepSpeed: every process would "
                             "have to take the same SFT step.")

    def _train_metrics(self):
        # where _sft_step_and_log puts sft/* and update_norm/*: ESTrainer's own metrics dict, logged with its metrics
        return self._metrics

    def _start_averaging(self) -> None:
        # the seed log holds the ES share only: say so, so that replay refuses it (an SFT delta a step would be one
        # fp32 copy of the trained parameters, 540 MB for SmolLM2-135M)
        if self.args.sft_weight != 0:
            self.seed_log.header["not_replayable"] = (
                f"ES + SFT parallel averaging with sft_weight={self.args.sft_weight}: the seed log holds only the ES "
                "share of each update; the SFT deltas are not saved."
            )

    def _sft_targets(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, fp32 master) of every ES-trained tensor; the SFT optimizer owns the masters."""
        return list(zip(self._es_model_params, self.es_params.master_parameters(), strict=False))

    def _tell(self, members, fitness: torch.Tensor, learning_rate: float):
        """The ES share, the SFT step from the same snapshot, their average; returns the ES share's ``TellResult``."""
        args = self.args
        masters = self.es_params.master_parameters()
        theta_bar = snapshot(masters)  # the fp32 master
        # the seed log stores w_ES * alpha: theta_ES is bitwise what replay() computes from the record
        told = super()._tell(members, fitness, args.es_weight * learning_rate)
        theta_es = restore_snapshot(masters, theta_bar)  # the SFT step starts from theta_bar
        self.es_params.write_master_to_model_()  # the SFT forward reads the model's tensors: theta_bar there too
        self.sft_step.create_scheduler(self.state.max_steps)
        self.sft_step.targets = self._sft_targets()  # the SFT optimizer steps the fp32 masters, as ES does
        self._sft_step_and_log(theta_es, masters, theta_bar, float32=False)
        with torch.no_grad():
            for m, bar, es in zip(masters, theta_bar, theta_es, strict=True):
                m.copy_(es + args.sft_weight * (m - bar))  # float32, in this order
        self.es_params.write_master_to_model_()  # the average, cast once into the model's dtype
        return told
