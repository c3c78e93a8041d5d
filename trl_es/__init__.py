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
    "ESConfig",
    "ESParallelAveragingConfig",
    "ESParallelAveragingTrainer",
    "ESTrainer",
    "HyperESConfig",
    "HyperESTrainer",
    "ParallelAveragingConfig",
    "ParallelAveragingTrainer",
    "replay",
    "__version__",
]
