"""Unbiased pass@k estimator (Chen et al. 2021)."""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping, Sequence

import numpy as np

from ..files import save_figure

__all__ = [
    "PASS_AT_K_METRIC_PATH",
    "estimate_pass_at_k",
    "load_pass_at_k_metric",
    "mean_pass_at_k",
    "pass_at_k",
    "plot_pass_at_k_curves",
]

#: Path of the ``evaluate`` metric module shipped with the package (``trl_es/metrics/pass_at_k/pass_at_k.py``).
PASS_AT_K_METRIC_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "metrics", "pass_at_k", "pass_at_k.py"
)


def _check_count(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an integer, got {value!r} of type {type(value).__name__}.")
    value = int(value)
    if value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value}.")
    return value


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    r"""Unbiased estimate of pass@k for one problem.

    From Chen et al. 2021, "Evaluating Large Language Models Trained on Code", Sec. 2.1:
    with ``n`` samples of which ``c`` are correct,

    .. math::
        \text{pass@}k = 1 - \binom{n-c}{k} \Big/ \binom{n}{k}
                      = 1 - \prod_{i=n-c+1}^{n} \left(1 - \frac{k}{i}\right),

    the numerically stable product form of the paper's reference code (equal to 1 when ``n - c < k``).

    Args:
        num_samples (int): ``n``, number of samples drawn for the problem, ``n >= 1``.
        num_correct (int): ``c``, number of those samples that are correct, ``0 <= c <= n``.
        k (int): ``k``, the budget, ``1 <= k <= n``.

    Returns:
        float: the unbiased pass@k estimate in ``[0, 1]``. For ``k = 1`` it equals ``c / n``.

    Raises:
        TypeError: if an argument is not an integer.
        ValueError: if ``n < 1``, ``c < 0``, ``k < 1``, ``c > n`` or ``k > n``.
    """
    n = _check_count(num_samples, "num_samples", 1)
    c = _check_count(num_correct, "num_correct", 0)
    k = _check_count(k, "k", 1)
    if c > n:
        raise ValueError(f"`num_correct` ({c}) must be <= `num_samples` ({n}).")
    if k > n:
        raise ValueError(f"`k` ({k}) must be <= `num_samples` ({n}): pass@k needs at least k samples per problem.")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def estimate_pass_at_k(num_samples: int | Sequence[int], num_correct: Sequence[int], k: int) -> np.ndarray:
    r"""Per-problem unbiased pass@k estimates (Chen et al. 2021, Sec. 2.1; see :func:`pass_at_k`).

    Args:
        num_samples (int or sequence of int): ``n`` per problem, or one ``n`` shared by all problems.
        num_correct (sequence of int): ``c`` per problem, length ``P``.
        k (int): the budget, ``1 <= k <= n`` for every problem.

    Returns:
        np.ndarray: shape ``(P,)``, dtype float64, pass@k of each problem.

    Raises:
        TypeError: if a count is not an integer.
        ValueError: if ``num_correct`` is empty, the lengths differ, or a count is out of range
            (see :func:`pass_at_k`).
    """
    correct = list(num_correct) if not isinstance(num_correct, numbers.Integral) else [num_correct]
    if len(correct) == 0:
        raise ValueError("`num_correct` must contain at least one problem.")
    if isinstance(num_samples, numbers.Integral):
        samples = [num_samples] * len(correct)
    else:
        samples = list(num_samples)
        if len(samples) != len(correct):
            raise ValueError(
                f"`num_samples` has {len(samples)} entries but `num_correct` has {len(correct)}; "
                "give one n per problem or a single int."
            )
    return np.array([pass_at_k(n, c, k) for n, c in zip(samples, correct)], dtype=np.float64)


def mean_pass_at_k(num_samples: int | Sequence[int], num_correct: Sequence[int], k: int) -> float:
    r"""Mean over problems of the unbiased pass@k estimate (Chen et al. 2021, Sec. 2.1).

    .. math:: \text{pass@}k = \frac{1}{P} \sum_{p=1}^{P} \Big[1 - \prod_{i=n_p-c_p+1}^{n_p} (1 - k/i)\Big]

    Args:
        num_samples (int or sequence of int): ``n`` per problem, or one ``n`` shared by all problems.
        num_correct (sequence of int): ``c`` per problem.
        k (int): the budget, ``1 <= k <= n`` for every problem.

    Returns:
        float: the mean pass@k.

    Raises:
        TypeError, ValueError: as :func:`estimate_pass_at_k`.
    """
    return float(estimate_pass_at_k(num_samples, num_correct, k).mean())


def load_pass_at_k_metric(**kwargs):
    """Load the package's pass@k metric through the Hugging Face ``evaluate`` library, offline.

    The metric module lives in the installed package (``trl_es/metrics/pass_at_k/pass_at_k.py``); this resolves its
    path and calls ``evaluate.load(path)``, so nothing is fetched from the hub. Usage::

        metric = load_pass_at_k_metric()
        metric.compute(predictions=[3, 0], references=[10, 10], k=[1, 5])
        # {'pass@1': 0.15000000000000002, 'pass@5': 0.4583333333333333}

    ``predictions`` are the numbers of correct samples per problem, ``references`` the numbers of samples drawn per
    problem, ``k`` an int or list of ints.

    Args:
        **kwargs: forwarded to ``evaluate.load`` (e.g. ``experiment_id``, ``keep_in_memory``).

    Returns:
        evaluate.EvaluationModule: the loaded metric.

    Raises:
        ImportError: if ``evaluate`` is not installed (``pip install trl-es[evaluate]``).
    """
    try:
        import evaluate
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "`load_pass_at_k_metric` needs the `evaluate` package: pip install 'trl-es[evaluate]'."
        ) from err
    return evaluate.load(PASS_AT_K_METRIC_PATH, **kwargs)


def plot_pass_at_k_curves(
    curves: Mapping[str, Sequence[float]],
    ks: Sequence[int],
    path: str | os.PathLike,
    *,
    temperature: float = 1.0,
    split: str = "test split",
    title: str | None = None,
) -> None:
    """Write a PNG of Pass@K against K (log2 axis), one line per policy.

    Args:
        curves: label -> Pass@K values in ``[0, 1]``, one per entry of ``ks`` (e.g. :func:`mean_pass_at_k` per K).
        ks: the budgets K, increasing positive integers.
        path: the PNG file to write (matplotlib's Agg canvas: no display needed).
        temperature: the sampling temperature of the completions, for the y-axis label.
        split: what the prompts are, for the y-axis label.
        title: optional figure title.

    Raises:
        ValueError: if ``ks`` is empty or not increasing positive integers, or a curve's length differs from ``ks``'s.
    """
    ks = [int(k) for k in ks]
    if not ks or ks[0] < 1 or any(b <= a for a, b in zip(ks, ks[1:])):
        raise ValueError(f"`ks` must be increasing positive integers, got {ks}.")
    for label, values in curves.items():
        if len(values) != len(ks):
            raise ValueError(f"curve {label!r} has {len(values)} values for {len(ks)} values of `ks` ({ks}).")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(fig)  # Agg backend, without touching pyplot's global state
    ax = fig.add_subplot()
    for label, values in curves.items():
        ax.plot(ks, [float("nan") if v is None else v for v in values], "o-", lw=2, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("K (samples per prompt)")
    ax.set_ylabel(f"Pass@K ({split}, T={temperature:g})")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    save_figure(fig, path, dpi=120)
