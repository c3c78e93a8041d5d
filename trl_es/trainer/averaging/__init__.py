"""The RL + SFT parallel-averaging trainer family (arXiv 2606.04272): GRPO + SFT (:class:`ParallelAveragingTrainer`)
and ES + SFT (:class:`ESParallelAveragingTrainer`), which share the SFT step and the ``sft_*`` fields."""

from .es_parallel_averaging_config import ESParallelAveragingConfig
from .es_parallel_averaging_trainer import ESParallelAveragingTrainer
from .parallel_averaging_config import ParallelAveragingConfig
from .parallel_averaging_trainer import ParallelAveragingTrainer


__all__ = ["ESParallelAveragingConfig", "ESParallelAveragingTrainer", "ParallelAveragingConfig",
           "ParallelAveragingTrainer"]
