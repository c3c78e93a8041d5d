"""The Hyper-ES trainer family (arXiv 2608.05541): :class:`HyperESConfig` and :class:`HyperESTrainer`, CMA-ES over
layer-wise DARE-TIES coefficients of LoRA deltas."""

from .hyper_es_config import HyperESConfig
from .hyper_es_trainer import HyperESTrainer


__all__ = ["HyperESConfig", "HyperESTrainer"]
