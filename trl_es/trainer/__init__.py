"""TRL glue: one config and one trainer a file, as TRL does."""

from .es_config import ESConfig
from .es_trainer import ESTrainer
from .hyper_es_config import HyperESConfig
from .hyper_es_trainer import HyperESTrainer

__all__ = ["ESConfig", "ESTrainer", "HyperESConfig", "HyperESTrainer"]
