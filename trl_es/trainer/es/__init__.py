"""The ES trainer family: :class:`ESConfig` and :class:`ESTrainer` (arXiv 2509.24372), with the mixins and helpers of
one ES iteration beside them."""

from .es_config import ESConfig
from .es_trainer import ESTrainer


__all__ = ["ESConfig", "ESTrainer"]
