"""TRL glue: one config and one trainer a file, as TRL does."""

from .es_config import ESConfig
from .es_parallel_averaging_config import ESParallelAveragingConfig
from .es_parallel_averaging_trainer import ESParallelAveragingTrainer
from .es_trainer import ESTrainer
from .hyper_es_config import HyperESConfig
from .hyper_es_trainer import HyperESTrainer
from .parallel_averaging_config import ParallelAveragingConfig
from .parallel_averaging_trainer import ParallelAveragingTrainer

__all__ = [
    "ESConfig",
    "ESParallelAveragingConfig",
    "ESParallelAveragingTrainer",
    "ESTrainer",
    "HyperESConfig",
    "HyperESTrainer",
    "ParallelAveragingConfig",
    "ParallelAveragingTrainer",
]
