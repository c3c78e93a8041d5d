"""Diagnostics of the ES-vs-GRPO fine-tuning papers, usable on any two checkpoints (ES, GRPO or other).

Each diagnostic lives in its own module; formulas and sources are in the docstrings and in ``docs/analysis.md``.

- :mod:`.pass_at_k`: unbiased pass@k (Chen et al. 2021) and its ``evaluate`` metric.
- :mod:`.drift`: parameter drift ||theta - theta_0||, overall and per module type.
- :mod:`.kl`: off-task KL drift on completions sampled from the current model.
- :mod:`.sparsity`: functional sparsity of an update (arXiv 2608.27351).
- :mod:`.mode_connectivity`: linear mode connectivity, barriers, update cosine (arXiv 2604.01499).
- :mod:`.diversity`: population success diversity JS_succ (arXiv 2608.27351).
- :mod:`.entropy`: mean token entropy of sampled completions, recorded during generation.
- :mod:`.fingerprint`: SHA-256 of a model's weights (equal means bitwise equal).
- :mod:`.policy_eval`: :func:`evaluate_policy`, one policy's accuracy, pass@k, JS_succ, entropy, drift and KL.
- :mod:`.protocol`: the papers' sampling protocol of Pass@K (T = 0.6, top-p 0.95, K up to 64).
- :mod:`.report`: :func:`analyze`, all of the above into ``report.json`` and PNG plots.
"""

from .diversity import binary_entropy, success_diversity, success_diversity_from_matrix
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
