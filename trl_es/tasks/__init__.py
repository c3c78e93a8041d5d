"""Tasks with verifiable rewards: a dataset builder (a ``prompt`` column and the columns its rewards read) and reward
functions with TRL's signature, for :class:`trl.GRPOTrainer` and :class:`trl_es.ESTrainer`; :func:`get_task` serves
the CLI.

========== ============================================ ==========================================
name       dataset builder                              reward functions (weights)
========== ============================================ ==========================================
countdown  :func:`~.countdown.make_countdown_dataset`   format (0.1), answer (1.0) - as the paper
arithmetic :func:`~.arithmetic.make_arithmetic_dataset` :func:`~.arithmetic.arithmetic_reward` (1.0)
gsm        :func:`~.gsm.make_gsm_dataset`               :func:`~.gsm.gsm_reward` (1.0)
========== ============================================ ==========================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from .arithmetic import (
    arithmetic_reward,
    make_arithmetic_dataset,
    make_arithmetic_dataset_dict,
    make_arithmetic_sft_dataset,
    make_arithmetic_splits,
)
from .countdown import (
    ANSWER_WEIGHT,
    FORMAT_WEIGHT,
    countdown_answer_reward,
    countdown_format_reward,
    countdown_reward,
    evaluate_expression,
    load_countdown_json,
    make_countdown_dataset,
)
from .gsm import gsm_reward, make_gsm_dataset


__all__ = [
    "TASKS",
    "Task",
    "arithmetic_reward",
    "countdown_answer_reward",
    "countdown_format_reward",
    "countdown_reward",
    "evaluate_expression",
    "get_task",
    "gsm_reward",
    "load_countdown_json",
    "make_arithmetic_dataset",
    "make_arithmetic_dataset_dict",
    "make_arithmetic_sft_dataset",
    "make_arithmetic_splits",
    "make_countdown_dataset",
    "make_gsm_dataset",
]


@dataclass(frozen=True)
class Task:
    """A task: its registry ``name``, a one-line ``description`` for ``--help``, a dataset builder and its rewards."""

    name: str
    description: str
    build_dataset: Callable  # build_dataset(n, seed=0, conversational=True, **options) -> n rows with a prompt column
    reward_funcs: list[Callable]  # TRL-style reward functions, a list as TRL's trainers expect
    reward_weights: list[float]  # one per reward function: pass as the config's reward_weights


TASKS: dict[str, Task] = {
    "countdown": Task(
        name="countdown",
        description="Countdown (Qiu et al. 2025): reach the target with each given number once, + - * /",
        build_dataset=make_countdown_dataset,
        reward_funcs=[countdown_format_reward, countdown_answer_reward],
        reward_weights=[FORMAT_WEIGHT, ANSWER_WEIGHT],
    ),
    "arithmetic": Task(
        name="arithmetic",
        description="'What is a + b? Reply with only the number.' (a, b in 1..50); reward: first stated result correct",
        build_dataset=make_arithmetic_dataset,
        reward_funcs=[arithmetic_reward],
        reward_weights=[1.0],
    ),
    "gsm": Task(
        name="gsm",
        description="GSM-style word problems (reasoning-gym gsm_symbolic), graded with math-verify",
        build_dataset=make_gsm_dataset,
        reward_funcs=[gsm_reward],
        reward_weights=[1.0],
    ),
}


def get_task(name: str) -> Task:
    """The task registered as ``name`` (``"countdown"``, ``"arithmetic"``, ``"gsm"``), with fresh reward lists.

    Raises:
        ValueError: If ``name`` is not a registered task (the message lists the allowed names).
    """
    try:
        task = TASKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}") from None
    # Fresh lists, so a caller that edits them does not change the registry.
    return replace(task, reward_funcs=list(task.reward_funcs), reward_weights=list(task.reward_weights))
