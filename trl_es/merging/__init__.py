"""Merging LoRA adapters: full deltas, layer-wise DARE-TIES, the Hyper-ES genome and its direction pool.

``build_direction_pool`` imports TRL's ``GRPOTrainer`` only when called.
"""

from .dare_ties import (
    MAJORITY_SIGN_METHODS,
    SIGN_ELECTIONS,
    MergeApplier,
    dare_prune,
    dare_ties_merge,
    merge_module_deltas,
    module_seed,
    ties_merge,
)
from .direction_pool import DEFAULT_TARGET_MODULES, build_direction_pool, sampled_success_rates, split_buckets
from .genome import GRANULARITIES, Genome, GenomeSpace, group_modules, layer_index
from .lora_delta import (
    DenseDelta,
    LoraDeltaSet,
    LoraFactors,
    check_adapter_config,
    extract_lora_factors,
    low_rank_factors,
    save_deltas_as_lora,
)


__all__ = [
    "DEFAULT_TARGET_MODULES",
    "DenseDelta",
    "GRANULARITIES",
    "MAJORITY_SIGN_METHODS",
    "SIGN_ELECTIONS",
    "Genome",
    "GenomeSpace",
    "LoraDeltaSet",
    "LoraFactors",
    "MergeApplier",
    "build_direction_pool",
    "check_adapter_config",
    "dare_prune",
    "dare_ties_merge",
    "extract_lora_factors",
    "group_modules",
    "layer_index",
    "low_rank_factors",
    "merge_module_deltas",
    "module_seed",
    "sampled_success_rates",
    "save_deltas_as_lora",
    "split_buckets",
    "ties_merge",
]
