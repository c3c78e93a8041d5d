"""ParallelAveragingTrainer: TRL's GRPOTrainer, with an SFT update averaged into every optimizer step."""

from __future__ import annotations

import textwrap

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer

from .parallel_averaging_config import ParallelAveragingConfig
from .sft_averaging import SFTAveragingTrainerMixin, restore_snapshot, snapshot


__all__ = ["ParallelAveragingTrainer", "average_updates_"]


@torch.no_grad()
def average_updates_(
    params: list[torch.Tensor], theta_bar: list[torch.Tensor], theta_a: list[torch.Tensor], weight_a: float,
    weight_b: float,
) -> None:
    r"""In place, :math:`\theta \leftarrow \bar\theta + w_a (\theta_a - \bar\theta) + w_b (\theta_b - \bar\theta)`
    (arXiv 2606.04272) per tensor in float32, cast to the dtype of ``params`` (holding :math:`\theta_b` on entry).

    Raises:
        ValueError: if the lists differ in length.
    """
    if not len(params) == len(theta_bar) == len(theta_a):
        raise ValueError(f"average_updates_ needs lists of one length, got {len(params)}, {len(theta_bar)}, "
                         f"{len(theta_a)}.")
    for p, bar, a in zip(params, theta_bar, theta_a, strict=False):
        bar32, a32, b32 = bar.float(), a.float(), p.float()
        p.copy_(bar32 + weight_a * (a32 - bar32) + weight_b * (b32 - bar32))  # as the formula reads


class _AverageAroundOptimizerStep(TrainerCallback):
    """Snapshot theta_bar before the RL optimizer steps; after it, take the SFT step from theta_bar and average."""

    def __init__(self, trainer: ParallelAveragingTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        # the SFT schedule spans the RL run's steps, known only once training begins
        self.trainer.sft_step.create_scheduler(state.max_steps)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._snapshot_theta_bar()  # the weights the RL gradient was computed at

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._average_with_sft_step()  # the RL step is taken: its update is theta - theta_bar


class ParallelAveragingTrainer(SFTAveragingTrainerMixin, GRPOTrainer):
    r"""GRPO and SFT updates averaged in parallel at every step (*RL Excursions during Pre-Training*, Bansal, Mohri,
    Qin, Alvarez-Melis, Kakade 2026, arXiv 2606.04272):

    .. math::
        \theta \leftarrow \bar\theta + w_{\mathrm{RL}}\,\Delta_{\mathrm{RL}} + w_{\mathrm{SFT}}\,\Delta_{\mathrm{SFT}},
        \qquad (w_{\mathrm{RL}}, w_{\mathrm{SFT}}) = (1/2, 1/2) \text{ by default}.

    :math:`\Delta_{\mathrm{RL}}` is ``GRPOTrainer``'s own optimizer step, unchanged; :math:`\Delta_{\mathrm{SFT}}`
    one step of a separate optimizer of the same class (:class:`~trl_es.trainer.averaging.sft_step.SFTStep`), both
    from :math:`\bar\theta`, over every trainable parameter.

    The arguments are ``trl.GRPOTrainer``'s (``args``: a :class:`ParallelAveragingConfig`; ``optimizers``: the RL
    side's), plus ``sft_dataset``: the SFT data, in a format ``trl.SFTTrainer`` accepts (e.g.
    :func:`trl_es.tasks.arithmetic.make_arithmetic_sft_dataset`).

    Raises:
        ValueError: without ``sft_dataset``, with several processes, or under DeepSpeed / FSDP.
        TypeError: if ``args`` is not a :class:`ParallelAveragingConfig`.
    """

    _tag_names = ["trl", "grpo", "sft", "parallel-averaging"]
    _name = "Parallel averaging (GRPO + SFT)"
    _paper = {
        "title": "RL Excursions during Pre-Training: Re-examining Policy Optimization for LLM training",
        "id": "2606.04272",
        "citation": textwrap.dedent("""\
            @article{bansal2026rlexcursions,
                title   = {{RL Excursions during Pre-Training: Re-examining Policy Optimization for LLM training}},
                author  = {Rachit Bansal and Clara Mohri and Tian Qin and David Alvarez-Melis and Sham Kakade},
                year    = 2026,
                eprint  = {arXiv:2606.04272}
            }"""),
    }

    _averaging_config_class = ParallelAveragingConfig
    _averaging_output_suffix = "-ParallelAveraging"
    _averaging_update = "rl"

    def _check_one_process(self) -> None:
        # the SFT step runs outside the Trainer's distributed wrapping
        if self.accelerator.num_processes > 1 or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("ParallelAveragingTrainer runs in one process, without DeepSpeed or FSDP: its SFT step "
                             "runs outside the Trainer's distributed wrapping.")

    def _train_metrics(self):
        # GRPOTrainer's per-mode lists, averaged into its next log: sft/* and update_norm/* land beside its metrics
        return self._metrics["train"]

    def _start_averaging(self) -> None:
        self._theta_bar: list[torch.Tensor] | None = None
        self.add_callback(_AverageAroundOptimizerStep(self))  # on transformers' on_(pre_)optimizer_step events

    def _averaged_parameters(self) -> list[torch.Tensor]:
        """Every trainable parameter of the (unwrapped) model, tied weights once."""
        return [p for p in self.accelerator.unwrap_model(self.model).parameters() if p.requires_grad]

    def _snapshot_theta_bar(self) -> None:
        self._theta_bar = snapshot(self._averaged_parameters())

    def _average_with_sft_step(self) -> None:
        """After the RL optimizer step: restore theta_bar, take the SFT step, write the weighted average."""
        if self._theta_bar is None:
            raise RuntimeError("The RL optimizer stepped without a theta_bar snapshot (on_pre_optimizer_step).")
        params, theta_bar = self._averaged_parameters(), self._theta_bar
        theta_rl = restore_snapshot(params, theta_bar)  # theta_bar + Delta_RL; the params hold theta_bar again
        # a separate optimizer with its own moments: each sees only its own gradients
        self._sft_step_and_log(theta_rl, params, theta_bar, float32=True)
        average_updates_(params, theta_bar, theta_rl, self.args.rl_weight, self.args.sft_weight)
        self._theta_bar = None  # one snapshot per optimizer step: a second step without one raises
