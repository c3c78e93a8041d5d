"""TRL glue, one room per trainer family (one config and one trainer a file, as TRL does):

- :mod:`.es`: ``ESConfig`` / ``ESTrainer`` (es_trainer.py: the iteration and every Trainer override but the
  checkpoint and distributed-setup hooks, each a mixin), what it logs (metrics, completion logs) and the
  GRPOConfig field table (grpo_fields.py);
- :mod:`.hyper_es`: ``HyperESConfig`` / ``HyperESTrainer`` (CMA-ES over DARE-TIES merges of LoRA deltas);
- :mod:`.averaging`: the RL + SFT parallel-averaging trainers (GRPO + SFT, ES + SFT) and their shared SFT step;
- :mod:`.distributed` and :mod:`.time_budget`: what every family shares.

A family may import :mod:`.es` (ES + SFT averaging subclasses ``ESTrainer``) and the shared modules, never another
family's trainer; ``tests/test_architecture.py`` checks it. Map of the rooms: ``docs/architecture.md``.
"""

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
