"""Diagnostics of the ES-vs-GRPO fine-tuning papers on any checkpoints (formulas and sources: ``docs/analysis.md``).

Pass@k (:mod:`.pass_at_k`, :mod:`.protocol`), parameter drift (:mod:`.drift`), off-task KL (:mod:`.kl`), functional
sparsity (:mod:`.sparsity`), mode connectivity (:mod:`.mode_connectivity`), success diversity (JS_succ, from
:mod:`trl_es.es.fitness`, which logs it each iteration), token entropy (:mod:`.entropy`), weight fingerprints;
:func:`evaluate_policy` and :func:`analyze` combine them.
"""

from ..es.fitness import binary_entropy, success_diversity, success_diversity_from_matrix
from .drift import parameter_drift, tensor_drift
from .entropy import TokenEntropyRecorder, mean_completion_entropy
from .fingerprint import weights_fingerprint
from .kl import encode_prompts, off_task_kl
from .mode_connectivity import barrier, interpolate_models, lm_loss_fn, mode_connectivity, update_cosine
from .pass_at_k import (
    PASS_AT_K_METRIC_PATH,
    estimate_pass_at_k,
    load_pass_at_k_metric,
    mean_pass_at_k,
    pass_at_k,
    plot_pass_at_k_curves,
)
from .policy_eval import SAMPLE_ROWS_PER_CALL, auto_sample_batch_size, evaluate_policy, greedy_accuracy, sample_policy
from .protocol import PAPER_PROTOCOL, UNIT_TEMPERATURE_PROTOCOL, SamplingProtocol, check_sampling
from .report import analyze
from .sparsity import KEEP_MODES, functional_sparsity, keep_update_fraction, reset_small_updates, update_fraction_curve


__all__ = [
    "PAPER_PROTOCOL",
    "SAMPLE_ROWS_PER_CALL",
    "PASS_AT_K_METRIC_PATH",
    "SamplingProtocol",
    "UNIT_TEMPERATURE_PROTOCOL",
    "TokenEntropyRecorder",
    "analyze",
    "auto_sample_batch_size",
    "barrier",
    "binary_entropy",
    "check_sampling",
    "encode_prompts",
    "estimate_pass_at_k",
    "evaluate_policy",
    "functional_sparsity",
    "keep_update_fraction",
    "update_fraction_curve",
    "KEEP_MODES",
    "greedy_accuracy",
    "interpolate_models",
    "lm_loss_fn",
    "load_pass_at_k_metric",
    "mean_completion_entropy",
    "mean_pass_at_k",
    "mode_connectivity",
    "off_task_kl",
    "parameter_drift",
    "pass_at_k",
    "plot_pass_at_k_curves",
    "reset_small_updates",
    "sample_policy",
    "success_diversity",
    "success_diversity_from_matrix",
    "tensor_drift",
    "update_cosine",
    "weights_fingerprint",
]
