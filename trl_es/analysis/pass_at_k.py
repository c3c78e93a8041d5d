"""Unbiased pass@k estimator (Chen et al. 2021, from ``trl_es/metrics/pass_at_k``), its ``evaluate`` metric, and Pass@K
curves.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from ..files import save_figure
from ..metrics.pass_at_k.estimator import estimate_pass_at_k, mean_pass_at_k, pass_at_k


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


def load_pass_at_k_metric(**kwargs):
    """The package's pass@k metric through ``evaluate.load`` (``**kwargs``), offline::

        load_pass_at_k_metric().compute(predictions=[3, 0], references=[10, 10], k=[1, 5])  # pass@1 0.15, pass@5 0.458

    Raises:
        ImportError: if ``evaluate`` is not installed (``pip install trl-es[evaluate]``).
    """
    try:
        import evaluate
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "`load_pass_at_k_metric` needs the `evaluate` package: pip install 'trl-es[evaluate]'."
        ) from err
    return evaluate.load(PASS_AT_K_METRIC_PATH, **kwargs)  # the installed module: nothing is fetched from the hub


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
        curves: label -> Pass@K values in ``[0, 1]``, one per entry of ``ks``.
        ks: the budgets K, increasing positive integers.
        temperature, split: the sampling temperature and the prompts, for the y-axis label.

    Raises:
        ValueError: if ``ks`` is empty or not increasing positive integers, or a curve's length differs from ``ks``'s.
    """
    ks = [int(k) for k in ks]
    if not ks or ks[0] < 1 or any(b <= a for a, b in zip(ks, ks[1:], strict=False)):  # increasing positive integers
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
        # a missing value leaves a gap
        ax.plot(ks, [float("nan") if v is None else v for v in values], "o-", lw=2, label=label)
    ax.set_xscale("log", base=2)  # K doubles from point to point
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("K (samples per prompt)")
    ax.set_ylabel(f"Pass@K ({split}, T={temperature:g})")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    save_figure(fig, path, dpi=120)
