"""ESParallelAveragingConfig: the configuration of ESParallelAveragingTrainer (ES and SFT updates averaged)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...arguments import document_parameters
from ..es.es_config import ESConfig
from .sft_averaging import SFTAveragingFields, update_weight_field
from .sft_step import check_averaging_fields


_ESWeightField = update_weight_field(
    "es_weight",
    "w_ES, the weight of the ES update: the ES step is taken with learning rate w_ES * alpha "
    "(recorded in the seed log). Default 1/2, as the RL weight of arXiv 2606.04272.",
)


@document_parameters(groups={  # the Parameters: of the docstring, from each field's help
    "Parameters that control the average": ("es_weight", "sft_weight"),
    "Parameters that control the SFT step": (
        "sft_learning_rate", "sft_per_device_train_batch_size", "sft_max_length", "sft_completion_only_loss",
        "sft_max_grad_norm"),
})
@dataclass
class ESParallelAveragingConfig(SFTAveragingFields, _ESWeightField, ESConfig):
    r"""
    Configuration class for [`ESParallelAveragingTrainer`]: the parallel-averaging rule of *RL Excursions during
    Pre-Training* (arXiv 2606.04272) with an ES update in place of the RL update. Per ES iteration, from the snapshot
    :math:`\bar\theta`:

    .. math::
        \theta \leftarrow \bar\theta + w_{\mathrm{ES}}\,\Delta_{\mathrm{ES}} + w_{\mathrm{SFT}}\,\Delta_{\mathrm{SFT}},

    where :math:`w_{\mathrm{ES}}\Delta_{\mathrm{ES}}` is the ES step (Qiu et al. 2025, arXiv 2509.24372, Algorithm 1,
    plus AWD if ``awd_lambda > 0``) taken with the learning rate :math:`w_{\mathrm{ES}}\,\alpha` (the seed log records
    that learning rate), and :math:`\Delta_{\mathrm{SFT}}` is one step of a separate torch optimizer on the SFT loss of
    an SFT batch at :math:`\bar\theta`.

    Every [`ESConfig`] field configures ES as in ``ESTrainer`` (``es_optimizer="es"`` only); the SFT optimizer is
    ``optim`` with the ``lr_scheduler_type`` schedule at ``sft_learning_rate``.
    """

    # no fallback of sft_* to the host's: ES's learning_rate is alpha, its max_grad_norm the ES gradient estimate's
    _sft_host_defaults = ()
    _optimizer_fields_read_elsewhere = ("weight_decay", "adam_beta1", "adam_beta2")  # the SFT optimizer's (no warning)

    sft_learning_rate: float = field(
        default=1e-5,
        metadata={"help": "Learning rate of the SFT optimizer (learning_rate is ES's alpha). Default 1e-5, the GRPO "
                  "learning rate of examples/studies/compare_es_grpo.py."},
    )
    sft_max_grad_norm: float = field(
        default=1.0,
        metadata={"help": "Clip the SFT gradient to this norm (0 = no clipping). Default 1.0, TrainingArguments' "
                  "(ESConfig's max_grad_norm is 0: the ES update has no gradient to clip)."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.es_optimizer != "es":  # the ES step is applied before the same iteration's SFT step
            raise ValueError(f"es_optimizer must be 'es' for ES + SFT parallel averaging, got {self.es_optimizer!r}: "
                             "the ES step must be applied before the SFT step of the same iteration.")
        check_averaging_fields(self, "es_weight")
