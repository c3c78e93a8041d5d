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

DEFAULT_TAUS = (0.0, 1e-6, 1e-5, 1e-4, 1e-3)  # sparsity thresholds, in parameter units
DEFAULT_TS = tuple(i / 10 for i in range(11))  # the mode-connectivity grid 0, 0.1, ..., 1


def _label(obj, fallback: str) -> str:
    if isinstance(obj, (str, os.PathLike)):
        return os.fspath(obj)
    return f"{fallback} ({type(obj).__name__})"


def _json_safe(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None  # report.json writes non-finite floats as null
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
    groups = list(dict.fromkeys(g for d in drift.values() for g in d["per_group"]))  # module types, in first-seen order
    width = 0.8 / len(drift)  # one bar per model in each group
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
    ax2 = ax.twinx()  # reward left, fraction reset right
    for name, d in sparsity.items():
        ax.plot(d["taus"], d["reward"], marker="o", label=f"reward {name}")
        ax2.plot(d["taus"], d["fraction_reset"], marker="x", linestyle="--", label=f"fraction reset {name}")
    # tau = 0 stays on a log axis
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
        # the barrier is measured from this chord
        ax.plot([0, 1], [ys[0], ys[-1]], linestyle=":", color="gray", label="chord")
        ax.set_xlabel(f"t  (0 = {a}, 1 = {b})")
        ax.set_ylabel(name)
        ax.set_title(f"{name} along the path, barrier {bar:.3g}")
        ax.legend()
    save_figure(fig, path, dpi=100)


def count_calls(fn: Callable[[nn.Module], float] | None, bar) -> Callable[[nn.Module], float] | None:
    """``fn`` that advances the tqdm ``bar`` by one after each call (``None`` stays ``None``)."""
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
    r"""Run every diagnostic the inputs allow; write ``report.json`` and PNG plots to ``output_dir`` (None: nothing).

    - ``drift``: :func:`~trl_es.analysis.parameter_drift` of ``a`` (and ``b``) from ``base``;
    - ``kl``: :func:`~trl_es.analysis.off_task_kl` on ``prompts`` (needs ``tokenizer`` and ``prompts``);
    - ``sparsity``: :func:`~trl_es.analysis.functional_sparsity` over ``taus`` (needs ``reward_fn``);
    - ``mode_connectivity``: :func:`~trl_es.analysis.mode_connectivity` from ``a`` to ``b`` (``base`` to ``a``
      without ``b``) over ``ts``, with ``reward_fn`` and ``loss_fn`` (default :func:`~trl_es.analysis.lm_loss_fn`);
    - ``update_cosine``: :func:`~trl_es.analysis.update_cosine` of ``a - base`` and ``b - base`` (needs ``b``).

    Models are modules or checkpoint paths (loaded on ``device`` with ``model_kwargs``); a ``tokenizer`` of None is
    loaded from a ``base_model`` path; ``max_new_tokens``, ``num_samples`` and ``seed`` are the KL's sampling.

    Returns:
        dict: ``{"models", "drift", "kl", "sparsity", "mode_connectivity", "update_cosine", "skipped", "plots"}``;
        a diagnostic that cannot run is None, with its reason under ``"skipped"``.
    """
    labels = {"base": _label(base_model, "base"), "a": _label(model_a, "a")}
    if model_b is not None:
        labels["b"] = _label(model_b, "b")
    if tokenizer is None and isinstance(base_model, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(os.fspath(base_model))  # the base checkpoint's tokenizer
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
    base_plain = merged_module(base)  # weight-space diagnostics compare plain modules
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
    with_kl = tokenizer is not None and bool(prompts)  # the KL and the default LMC loss need both
    if loss_fn is None and with_kl:
        loss_fn = lm_loss_fn(tokenizer, prompts)
    # One bar over every evaluation, named by stage: a run of many minutes shows what is done and what remains.
    steps = len(plain) * (1 + with_kl + (len(taus) if reward_fn is not None else 0))
    steps += len(ts) * ((reward_fn is not None) + (loss_fn is not None)) + ("b" in plain)
    bar = tqdm(total=steps, desc="analyze", unit="eval", disable=not is_main_process())  # the main process shows it
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
            # the KL samples from the model as given, PEFT or not
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
        a_name, b_name = ("a", "b") if "b" in plain else ("base", "a")  # two fine-tuned models, else base to a
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
        except ValueError as err:  # an identically zero update has no cosine
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
            # atomic: a reader never sees half a report
            write_json(os.path.join(output_dir, "report.json"), _json_safe(report), allow_nan=False)
    return report
