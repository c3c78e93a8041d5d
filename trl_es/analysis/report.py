"""One-call report of the ES-vs-GRPO diagnostics for a base checkpoint and one or two fine-tuned checkpoints."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

from torch import nn
from tqdm.auto import tqdm

from ..files import is_main_process, save_figure, write_json
from ._common import load_model, merged_module
from .drift import parameter_drift
from .kl import off_task_kl
from .mode_connectivity import lm_loss_fn, mode_connectivity, update_cosine
from .sparsity import functional_sparsity


__all__ = ["analyze"]

DEFAULT_TAUS = (0.0, 1e-6, 1e-5, 1e-4, 1e-3)
DEFAULT_TS = tuple(i / 10 for i in range(11))


def _label(obj, fallback: str) -> str:
    if isinstance(obj, (str, os.PathLike)):
        return os.fspath(obj)
    return f"{fallback} ({type(obj).__name__})"


def _json_safe(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _new_figure(width: float = 7.0, height: float = 4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # Agg backend, without touching pyplot's global state
    return fig


def _plot_drift(drift: dict, path: str) -> None:
    fig = _new_figure(max(7.0, 0.5 * len(next(iter(drift.values()))["per_group"])), 4.0)
    ax = fig.add_subplot()
    groups = list(dict.fromkeys(g for d in drift.values() for g in d["per_group"]))
    width = 0.8 / len(drift)
    for i, (name, d) in enumerate(drift.items()):
        xs = [j + i * width for j in range(len(groups))]
        ys = [d["per_group"].get(g, {}).get("relative", float("nan")) for g in groups]
        ax.bar(xs, ys, width=width, label=f"{name} (total {d['relative']:.3g})")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], groups, rotation=45, ha="right")
    ax.set_ylabel(r"$\|\theta-\theta_0\| / \|\theta_0\|$")
    ax.set_title("Relative parameter drift per module type")
    ax.legend()
    save_figure(fig, path, dpi=100)


def _plot_kl(kl: dict, path: str) -> None:
    fig = _new_figure()
    ax = fig.add_subplot()
    width = 0.8 / len(kl)
    for i, (name, d) in enumerate(kl.items()):
        xs = [j + i * width for j in range(len(d["per_prompt"]))]
        ax.bar(xs, d["per_prompt"], width=width, label=f"{name} (mean {d['kl']:.3g})")
    ax.set_xlabel("prompt")
    ax.set_ylabel("KL per token (nats)")
    ax.set_title("Off-task KL drift from the base model")
    ax.legend()
    save_figure(fig, path, dpi=100)


def _plot_sparsity(sparsity: dict, path: str) -> None:
    fig = _new_figure()
    ax = fig.add_subplot()
    ax2 = ax.twinx()
    for name, d in sparsity.items():
        ax.plot(d["taus"], d["reward"], marker="o", label=f"reward {name}")
        ax2.plot(d["taus"], d["fraction_reset"], marker="x", linestyle="--", label=f"fraction reset {name}")
    ax.set_xscale("symlog", linthresh=min([t for d in sparsity.values() for t in d["taus"] if t > 0] or [1e-6]))
    ax.set_xlabel(r"$\tau$")
    ax.set_ylabel("reward")
    ax2.set_ylabel("fraction of coordinates reset")
    ax.set_title("Functional sparsity")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="best")
    save_figure(fig, path, dpi=100)


def _plot_lmc(lmc: dict, path: str) -> None:
    curves = [(k, lmc[k], lmc[f"{k}_barrier"]) for k in ("reward", "loss") if lmc.get(k) is not None]
    fig = _new_figure(5.0 * len(curves), 4.0)
    a, b = lmc["endpoints"]
    for i, (name, ys, bar) in enumerate(curves):
        ax = fig.add_subplot(1, len(curves), i + 1)
        ts = lmc["ts"]
        ax.plot(ts, ys, marker="o", label=name)
        ax.plot([0, 1], [ys[0], ys[-1]], linestyle=":", color="gray", label="chord")
        ax.set_xlabel(f"t  (0 = {a}, 1 = {b})")
        ax.set_ylabel(name)
        ax.set_title(f"{name} along the path, barrier {bar:.3g}")
        ax.legend()
    save_figure(fig, path, dpi=100)


def count_calls(fn: Callable[[nn.Module], float] | None, bar) -> Callable[[nn.Module], float] | None:
    """``fn``, advancing the progress bar ``bar`` (``tqdm``) by one after each call (``None`` stays ``None``): the
    evaluations a diagnostic makes (a reward per threshold, per point of a path) show as progress."""
    if fn is None:
        return None

    def counted(model: nn.Module) -> float:
        value = fn(model)
        bar.update(1)
        return value

    return counted


def analyze(
    base_model: nn.Module | str,
    model_a: nn.Module | str,
    model_b: nn.Module | str | None = None,
    tokenizer=None,
    prompts: Sequence | None = None,
    reward_fn: Callable[[nn.Module], float] | None = None,
    taus: Sequence[float] = DEFAULT_TAUS,
    ts: Sequence[float] = DEFAULT_TS,
    output_dir: str | os.PathLike | None = None,
    *,
    loss_fn: Callable[[nn.Module], float] | None = None,
    max_new_tokens: int = 32,
    num_samples: int = 1,
    seed: int = 0,
    device=None,
    model_kwargs: dict | None = None,
) -> dict:
    r"""Run every diagnostic the inputs allow and write ``report.json`` and PNG plots.

    Computed (each skipped with a reason recorded under ``"skipped"`` when its inputs are missing):

    - ``drift``: :func:`~trl_es.analysis.parameter_drift` of ``a`` (and ``b``) from ``base``; plot ``drift.png``.
    - ``kl``: :func:`~trl_es.analysis.off_task_kl` of ``a`` (and ``b``) from ``base`` on ``prompts``
      (needs ``tokenizer`` and ``prompts``); plot ``kl.png``.
    - ``sparsity``: :func:`~trl_es.analysis.functional_sparsity` of ``a`` (and ``b``) over ``taus`` (needs
      ``reward_fn``); plot ``sparsity.png``.
    - ``mode_connectivity``: :func:`~trl_es.analysis.mode_connectivity` between ``a`` and ``b`` (between
      ``base`` and ``a`` when ``b`` is None) over ``ts`` with ``reward_fn`` and ``loss_fn``; when ``loss_fn`` is None
      and a tokenizer and prompts are given, the loss is :func:`~trl_es.analysis.lm_loss_fn` on the prompts;
      plot ``mode_connectivity.png``.
    - ``update_cosine``: :func:`~trl_es.analysis.update_cosine` of the updates ``a - base`` and ``b - base``
      (needs ``b``).

    A tqdm bar (main process) counts every evaluation (each reward / loss call, each model's drift and KL) and
    names the stage in progress. Formulas and sources are in each function's docstring and in ``docs/analysis.md``. PEFT
    models are merged once (into copies) for the weight-space diagnostics. Plots use matplotlib's Agg canvas (no display
    needed).

    Args:
        base_model (nn.Module | str): the common base theta_0, or a checkpoint path.
        model_a (nn.Module | str): first fine-tuned model (e.g. ES), or a path.
        model_b (nn.Module | str | None): optional second fine-tuned model (e.g. GRPO), or a path.
        tokenizer (PreTrainedTokenizerBase | str | None): tokenizer, or a path; when None and ``base_model`` is a
            path, loaded from it with ``AutoTokenizer``.
        prompts (Sequence[str | list[dict]] | None): off-task prompts for the KL (and default LMC loss).
        reward_fn (Callable[[nn.Module], float] | None): scores a model (higher is better).
        taus (Sequence[float]): sparsity thresholds (>= 0).
        ts (Sequence[float]): LMC grid in [0, 1].
        output_dir (str | None): where to write ``report.json`` and the PNGs (created if needed); None writes
            nothing.
        loss_fn (Callable[[nn.Module], float] | None): LMC loss (lower is better).
        max_new_tokens (int): completion length for the KL.
        num_samples (int): completions per prompt for the KL.
        seed (int): sampling seed for the KL.
        device (str | torch.device | None): device for models loaded from paths.
        model_kwargs (dict | None): extra ``from_pretrained`` kwargs for models loaded from paths (e.g. ``dtype``).

    Returns:
        dict: ``{"models", "drift", "kl", "sparsity", "mode_connectivity", "update_cosine", "skipped", "plots"}``;
        absent diagnostics are None. In ``report.json`` non-finite floats are written as ``null``.

    Raises:
        ValueError, TypeError: from the individual diagnostics on invalid inputs.
    """
    labels = {"base": _label(base_model, "base"), "a": _label(model_a, "a")}
    if model_b is not None:
        labels["b"] = _label(model_b, "b")
    if tokenizer is None and isinstance(base_model, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(os.fspath(base_model))
    elif isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(os.fspath(tokenizer))

    base = load_model(base_model, device=device, model_kwargs=model_kwargs)
    models = {"a": load_model(model_a, device=device, model_kwargs=model_kwargs)}
    if model_b is not None:
        models["b"] = load_model(model_b, device=device, model_kwargs=model_kwargs)
    for name, m in (("base_model", base), *((f"model_{k}", v) for k, v in models.items())):
        if not isinstance(m, nn.Module):
            raise TypeError(f"`{name}` must be a model or a checkpoint path, got {type(m).__name__}.")
    base_plain = merged_module(base)
    plain = {k: merged_module(m) for k, m in models.items()}  # PEFT merged once, reused below

    report: dict = {
        "models": labels,
        "drift": None,
        "kl": None,
        "sparsity": None,
        "mode_connectivity": None,
        "update_cosine": None,
        "skipped": {},
        "plots": [],
    }
    with_kl = tokenizer is not None and bool(prompts)
    if loss_fn is None and with_kl:
        loss_fn = lm_loss_fn(tokenizer, prompts)
    # One bar over every evaluation, named by stage: a run of many minutes shows what is done and what remains.
    steps = len(plain) * (1 + with_kl + (len(taus) if reward_fn is not None else 0))
    steps += len(ts) * ((reward_fn is not None) + (loss_fn is not None)) + ("b" in plain)
    bar = tqdm(total=steps, desc="analyze", unit="eval", disable=not is_main_process())
    reward_fn, loss_fn = count_calls(reward_fn, bar), count_calls(loss_fn, bar)

    report["drift"] = {}
    for k, m in plain.items():
        bar.set_description(f"drift of model {k}")
        report["drift"][k] = parameter_drift(m, base_plain)
        bar.update(1)

    if with_kl:
        report["kl"] = {}
        for k, m in models.items():
            bar.set_description(f"off-task KL of model {k} ({len(prompts)} prompts)")
            report["kl"][k] = off_task_kl(m, base, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                          num_samples=num_samples, seed=seed)
            bar.update(1)
    else:
        report["skipped"]["kl"] = "needs `tokenizer` and `prompts`"

    if reward_fn is not None:
        report["sparsity"] = {}
        for k, m in plain.items():
            bar.set_description(f"sparsity of model {k} ({len(taus)} thresholds)")
            report["sparsity"][k] = functional_sparsity(m, base_plain, taus, reward_fn)
    else:
        report["skipped"]["sparsity"] = "needs `reward_fn`"

    if reward_fn is not None or loss_fn is not None:
        a_name, b_name = ("a", "b") if "b" in plain else ("base", "a")
        end_a = plain["a"] if a_name == "a" else base_plain
        end_b = plain[b_name]
        bar.set_description(f"mode connectivity {a_name} -> {b_name} ({len(ts)} points)")
        lmc = mode_connectivity(end_a, end_b, ts, reward_fn=reward_fn, loss_fn=loss_fn)
        lmc["endpoints"] = [a_name, b_name]
        report["mode_connectivity"] = lmc
    else:
        report["skipped"]["mode_connectivity"] = "needs `reward_fn`, `loss_fn`, or `tokenizer` and `prompts`"

    if "b" in plain:
        bar.set_description("update cosine")
        try:
            report["update_cosine"] = update_cosine(plain["a"], plain["b"], base_plain)
        except ValueError as err:
            report["skipped"]["update_cosine"] = str(err)
        bar.update(1)
    else:
        report["skipped"]["update_cosine"] = "needs `model_b`"
    bar.close()

    if output_dir is not None:  # every process computed the same report: the main one writes it
        output_dir = os.fspath(output_dir)
        writes = is_main_process()
        if writes:
            os.makedirs(output_dir, exist_ok=True)
        plotters = [
            ("drift.png", _plot_drift, report["drift"]),
            ("kl.png", _plot_kl, report["kl"]),
            ("sparsity.png", _plot_sparsity, report["sparsity"]),
            ("mode_connectivity.png", _plot_lmc, report["mode_connectivity"]),
        ]
        for filename, plot, data in plotters:
            if data:
                if writes:
                    plot(data, os.path.join(output_dir, filename))
                report["plots"].append(filename)
        if writes:
            write_json(os.path.join(output_dir, "report.json"), _json_safe(report), allow_nan=False)
    return report
