"""The PNG of a training run: population reward per iteration and eval-split accuracy at each evaluation."""

from __future__ import annotations

from ..files import save_figure


def plot_training_curves(log_history: list[dict], accuracy_key: str, path: str, accuracy_before=None,
                         label: str = "validation accuracy (greedy)") -> None:
    """PNG at ``path`` of the population reward per iteration and the ``accuracy_key`` accuracy at each evaluation.

    ``log_history`` is ``trainer.state.log_history``; ``accuracy_before`` (optional) is plotted at iteration 0 and
    ``label`` names the accuracy curve.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    train = [h for h in log_history if "reward" in h and "step" in h]  # the training logs, one per iteration
    evals = [h for h in log_history if accuracy_key in h]  # the evaluations
    if accuracy_before is not None:
        evals = [{"step": 0, accuracy_key: accuracy_before}, *evals]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot([h["step"] for h in train], [h["reward"] for h in train], label="population mean reward (train)")
        ax.fill_between([h["step"] for h in train], [h["reward_min"] for h in train],  # the population's spread
                        [h["reward_max"] for h in train], alpha=0.2, label="population min-max")
    if evals:
        ax.plot([h["step"] for h in evals], [h[accuracy_key] for h in evals], "o-", label=label)
    ax.set_xlabel("ES iteration")
    ax.set_ylabel("reward / accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)  # pyplot keeps every open figure otherwise
