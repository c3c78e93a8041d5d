"""The ES algorithm on any ``nn.Module`` (ask/tell :class:`EvolutionStrategy`, noise, perturbations, shaping,
update, population backends, seed log) and CMA-ES in the unit box (:mod:`.cma_search`); no TRL imports.
"""

from .cma_search import CMASearch, stand_in_fitness
from .fitness import MemberScores, PopulationScores
from .noise import (
    NOISE_BLOCK_SIZE,
    NOISE_SOURCES,
    DeviceGaussianNoise,
    GaussianNoise,
    NoiseSource,
    NoiseTable,
    full_noise,
    make_noise_source,
    register_noise_source,
)
from .perturbation import (
    GaussianPerturbation,
    LowRankAdapters,
    LowRankPerturbation,
    Perturbation,
    linear_weight_names,
    lowrank_factors,
    lowrank_perturbation,
)
from .population import (
    POPULATION_BACKENDS,
    BatchedLowRankPopulation,
    PopulationBackend,
    SequentialPopulation,
    make_population_backend,
    member_indices,
    member_seed,
    sample_population,
)
from .seedlog import SEED_LOG_NAME, SeedLog, replay
from .shaping import FITNESS_SHAPINGS, centered_ranks, merge_ties, shape_fitness
from .strategy import EvolutionStrategy, TellResult
from .update import Member, TrainedParameters, es_gradient_, es_update_, select_parameters


__all__ = [
    "FITNESS_SHAPINGS",
    "NOISE_BLOCK_SIZE",
    "NOISE_SOURCES",
    "POPULATION_BACKENDS",
    "BatchedLowRankPopulation",
    "CMASearch",
    "DeviceGaussianNoise",
    "EvolutionStrategy",
    "GaussianNoise",
    "GaussianPerturbation",
    "LowRankAdapters",
    "LowRankPerturbation",
    "Member",
    "MemberScores",
    "NoiseSource",
    "NoiseTable",
    "Perturbation",
    "PopulationBackend",
    "PopulationScores",
    "SEED_LOG_NAME",
    "SeedLog",
    "SequentialPopulation",
    "TellResult",
    "TrainedParameters",
    "centered_ranks",
    "es_gradient_",
    "es_update_",
    "full_noise",
    "linear_weight_names",
    "lowrank_factors",
    "lowrank_perturbation",
    "make_noise_source",
    "make_population_backend",
    "member_indices",
    "member_seed",
    "merge_ties",
    "register_noise_source",
    "replay",
    "sample_population",
    "select_parameters",
    "shape_fitness",
    "stand_in_fitness",
]
