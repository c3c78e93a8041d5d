"""TRL glue: one config and one trainer a file, as TRL does."""

from .es_config import ESConfig
from .es_trainer import ESTrainer

__all__ = ["ESConfig", "ESTrainer"]
