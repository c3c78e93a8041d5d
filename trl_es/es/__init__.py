"""The ES algorithm on any ``nn.Module``: noise, fitness shaping, the update, population evaluation, the seed log.

Nothing here imports TRL or ``transformers.Trainer``.
"""

from .noise import NOISE_BLOCK_SIZE, GaussianNoise, NoiseSource, NoiseTable, full_noise, make_noise_source
from .population import (
    PopulationBackend,
    SequentialPopulation,
    member_indices,
    member_seed,
    sample_population,
)
from .seedlog import SEED_LOG_NAME, SeedLog, replay
from .shaping import FITNESS_SHAPINGS, centered_ranks, shape_fitness
from .update import Member, TrainedParameters, select_parameters

__all__ = [
    "FITNESS_SHAPINGS",
    "NOISE_BLOCK_SIZE",
    "GaussianNoise",
    "Member",
    "NoiseSource",
    "NoiseTable",
    "PopulationBackend",
    "SEED_LOG_NAME",
    "SeedLog",
    "SequentialPopulation",
    "TrainedParameters",
    "centered_ranks",
    "full_noise",
    "make_noise_source",
    "member_indices",
    "member_seed",
    "replay",
    "sample_population",
    "select_parameters",
    "shape_fitness",
]
