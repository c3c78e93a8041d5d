"""trl_es: Evolution Strategies fine-tuning of LLMs, as a member of the Hugging Face TRL family.

>>> from trl_es import ESConfig, ESTrainer   # instead of: from trl import GRPOConfig, GRPOTrainer
"""

__version__ = "0.1.0"

from .es.seedlog import replay
from .trainer import (
    ESConfig,
    ESParallelAveragingConfig,
    ESParallelAveragingTrainer,
    ESTrainer,
    HyperESConfig,
    HyperESTrainer,
    ParallelAveragingConfig,
    ParallelAveragingTrainer,
)


__all__ = [
    # the ES trainer path: GRPOTrainer's constructor, an ES iteration a step
    "ESConfig",
    "ESTrainer",
    "replay",  # rebuild trained weights from a seed log
    # Hyper-ES: CMA-ES over DARE-TIES merges of LoRA deltas (arXiv 2608.05541)
    "HyperESConfig",
    "HyperESTrainer",
    # RL + SFT parallel averaging (arXiv 2606.04272): GRPO + SFT, ES + SFT
    "ParallelAveragingConfig",
    "ParallelAveragingTrainer",
    "ESParallelAveragingConfig",
    "ESParallelAveragingTrainer",
    "__version__",
]
