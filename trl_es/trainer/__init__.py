"""TRL glue, one room per trainer family (one config and one trainer a file, as TRL does).

- :mod:`.es`: ``ESConfig`` / ``ESTrainer``, their logs and GRPO's field table;
- :mod:`.hyper_es`: ``HyperESConfig`` / ``HyperESTrainer`` (CMA-ES over DARE-TIES merges of LoRA deltas);
- :mod:`.averaging`: the RL + SFT parallel-averaging trainers and their shared SFT step;
- :mod:`.distributed`, :mod:`.time_budget`: shared by every family.
"""

# A family imports .es (ES + SFT averaging subclasses ESTrainer) and the shared modules, never another family's
# trainer (tests/test_architecture.py); the map of the rooms is docs/architecture.md.

from .averaging import (
    ESParallelAveragingConfig,
    ESParallelAveragingTrainer,
    ParallelAveragingConfig,
    ParallelAveragingTrainer,
)
from .es import ESConfig, ESTrainer
from .hyper_es import HyperESConfig, HyperESTrainer


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
