"""ParallelAveragingConfig: the configuration of ParallelAveragingTrainer (GRPO and SFT updates averaged per step)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from ...arguments import check_finite_floats, document_parameters
from .sft_averaging import SFTAveragingFields, update_weight_field
from .sft_step import check_averaging_fields


_RLWeightField = update_weight_field(
    "rl_weight",
    "w_RL, the weight of the RL (GRPO) update Delta_RL in theta_bar + w_RL Delta_RL + w_SFT "
    "Delta_SFT. Default 1/2 (arXiv 2606.04272).",
)


@document_parameters(groups={  # the Parameters: of the docstring, from each field's help
    "Parameters that control the average": ("rl_weight", "sft_weight"),
    "Parameters that control the SFT step": (
        "sft_learning_rate", "sft_per_device_train_batch_size", "sft_max_length", "sft_completion_only_loss",
        "sft_max_grad_norm"),
    "Parameters that override `GRPOConfig` defaults": ("activation_checkpointing", "gradient_checkpointing"),
})
@dataclass
class ParallelAveragingConfig(SFTAveragingFields, _RLWeightField, GRPOConfig):
    r"""
    Configuration class for [`ParallelAveragingTrainer`]: parallel averaging of an RL (GRPO) update and an SFT update,
    the rule of *RL Excursions during Pre-Training* (Bansal, Mohri, Qin et al. 2026, arXiv 2606.04272). Per step, from
    the snapshot :math:`\bar\theta`:

    .. math::
        \theta \leftarrow \bar\theta + w_{\mathrm{RL}}\,\Delta_{\mathrm{RL}} + w_{\mathrm{SFT}}\,\Delta_{\mathrm{SFT}},

    where :math:`\Delta_{\mathrm{RL}}` is one step of the Trainer's optimizer on the GRPO loss of an RL batch and
    :math:`\Delta_{\mathrm{SFT}}` one step of a second, separate optimizer on the SFT loss of an SFT batch, both taken
    at :math:`\bar\theta`. The paper's weights are :math:`(1/2, 1/2)`.

    Every [`~trl.GRPOConfig`] field configures the RL side as in ``GRPOTrainer``; the SFT side copies the optimizer,
    schedule type, precision and seed (:func:`~trl_es.trainer.averaging.sft_step.sft_config_from`).
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

    def __post_init__(self):
        check_finite_floats(self)  # NaN / +-inf in any float field (inherited ones too), before anything else
        super().__post_init__()
        check_averaging_fields(self, "rl_weight")
