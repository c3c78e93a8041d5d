"""ParallelAveragingConfig: the configuration of ParallelAveragingTrainer (GRPO and SFT updates averaged per step)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from ..arguments import check_finite_floats
from .sft_step import check_averaging_fields


@dataclass
class ParallelAveragingConfig(GRPOConfig):
    r"""
    Configuration class for [`ParallelAveragingTrainer`]: parallel averaging of an RL (GRPO) update and an SFT update,
    the rule of *RL Excursions during Pre-Training* (Bansal, Mohri, Qin et al. 2026, arXiv 2606.04272). Per step, from
    the snapshot :math:`\bar\theta`:

    .. math::
        \theta \leftarrow \bar\theta + w_{\mathrm{RL}}\,\Delta_{\mathrm{RL}} + w_{\mathrm{SFT}}\,\Delta_{\mathrm{SFT}},

    where :math:`\Delta_{\mathrm{RL}}` is one step of the Trainer's optimizer on the GRPO loss of an RL batch and
    :math:`\Delta_{\mathrm{SFT}}` one step of a second, separate optimizer on the SFT loss of an SFT batch, both taken
    at :math:`\bar\theta`. The paper's weights are :math:`(1/2, 1/2)`.

    Every [`~trl.GRPOConfig`] field configures the RL side exactly as in ``GRPOTrainer`` (its optimizer, learning
    rate, schedule, generation, loss). The SFT side copies the optimizer class and its keyword arguments, the schedule
    type, precision and seed from these fields (see :func:`trl_es.trainer.sft_step.sft_config_from`), and takes the
    ``sft_*`` fields below.
    """

    # GRPOConfig's gradient checkpointing (on, TRL's default) under its transformers 5 name: the deprecated alias
    # gradient_checkpointing stays None unless set, so constructing the config prints no deprecation warning.
    activation_checkpointing: bool | None = field(
        default=True,
        metadata={"help": "Activation (gradient) checkpointing of the RL and SFT backward passes. Default True, "
                  "GRPOConfig's gradient_checkpointing default."},
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of activation_checkpointing (transformers 5). Default None: use "
                  "activation_checkpointing."},
    )
    rl_weight: float = field(
        default=0.5,
        metadata={"help": "w_RL, the weight of the RL (GRPO) update Delta_RL in theta_bar + w_RL Delta_RL + w_SFT "
                  "Delta_SFT. Default 1/2 (arXiv 2606.04272)."},
    )
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

    def __post_init__(self):
        check_finite_floats(self)  # NaN / +-inf in any float field (inherited ones too), before anything else
        super().__post_init__()
        check_averaging_fields(self, "rl_weight")
