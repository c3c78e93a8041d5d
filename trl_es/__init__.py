"""trl_es: Evolution Strategies fine-tuning of LLMs, as a member of the Hugging Face TRL family.

>>> from trl_es import ESConfig, ESTrainer   # instead of: from trl import GRPOConfig, GRPOTrainer
"""

__version__ = "0.1.0"

from .es.seedlog import replay
from .trainer.es_config import ESConfig
from .trainer.es_parallel_averaging_config import ESParallelAveragingConfig
from .trainer.es_parallel_averaging_trainer import ESParallelAveragingTrainer
from .trainer.es_trainer import ESTrainer
from .trainer.hyper_es_config import HyperESConfig
from .trainer.hyper_es_trainer import HyperESTrainer
from .trainer.parallel_averaging_config import ParallelAveragingConfig
from .trainer.parallel_averaging_trainer import ParallelAveragingTrainer

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
