"""The three disjoint splits of a task: train (fitness), validation (tuning) and test (reports)."""

from __future__ import annotations

import json

from .arguments import SPLITS, TaskArguments


def task_splits(task_args: TaskArguments, conversational: bool = True):
    """The task (rewards and weights) and its ``"train"``, ``"validation"``, ``"test"`` splits, disjoint by prompt.

    Arithmetic: :func:`~trl_es.tasks.arithmetic.make_arithmetic_dataset_dict`; countdown with ``countdown_json``: the
    paper's first 200 items train, its last 2000 give test then validation; other tasks: ``2 x`` the rows generated
    with ``task_seed``, distinct prompts to test, then validation, then train.

    Args:
        task_args (`TaskArguments`): Task, sizes (``num_train_prompts``, ``num_validation_prompts``,
            ``num_eval_prompts`` for test) and ``task_seed``.
        conversational (`bool`, defaults to `True`): Prompts as chat messages (else plain strings).

    Raises:
        ValueError: If the sizes exceed what the task can provide, or the task is unknown.
    """
    from datasets import Dataset, DatasetDict

    from ..tasks import get_task

    task = get_task(task_args.task)
    n_train, n_validation, n_test = (
        task_args.num_train_prompts, task_args.num_validation_prompts, task_args.num_eval_prompts
    )
    if task_args.task == "countdown" and task_args.countdown_json:
        from ..tasks.countdown import load_countdown_json

        train = load_countdown_json(task_args.countdown_json, split="train")
        held_out = load_countdown_json(task_args.countdown_json, split="test")
        if n_test + n_validation > len(held_out):
            raise ValueError(
                f"num_eval_prompts + num_validation_prompts = {n_test} + {n_validation} exceeds the {len(held_out)} "
                f"held-out items of {task_args.countdown_json}."
            )
        return task, DatasetDict({
            "train": train,
            # the next num_validation_prompts
            "validation": held_out.select(list(range(n_test, n_test + n_validation))),
            "test": held_out.select(list(range(n_test))),  # the first num_eval_prompts of the held-out items
        })
    if task_args.task == "arithmetic":
        from ..tasks.arithmetic import make_arithmetic_dataset_dict

        splits = make_arithmetic_dataset_dict(  # the test split does not change with the other sizes
            n_train, n_validation, n_test, seed=task_args.task_seed, conversational=conversational
        )
        return task, splits
    # Other tasks: draw test rows first, then validation, then train rows, each prompt at most once.
    total = n_train + n_validation + n_test
    if total == 0:
        raise ValueError("num_train_prompts, num_validation_prompts and num_eval_prompts are all 0.")
    # twice the rows: room for repeated prompts
    rows = task.build_dataset(2 * total, seed=task_args.task_seed, conversational=conversational)
    wanted = {"test": n_test, "validation": n_validation, "train": n_train}
    drawn: dict[str, list] = {name: [] for name in wanted}
    seen = set()
    for row in rows:
        key = json.dumps(row["prompt"], sort_keys=True)  # a prompt's identity, chat messages included
        if key in seen:
            continue
        seen.add(key)
        # the first split still short
        name = next((n for n in ("test", "validation", "train") if len(drawn[n]) < wanted[n]), None)
        if name is None:
            break
        drawn[name].append(row)
    if any(len(drawn[n]) < wanted[n] for n in wanted):
        raise ValueError(
            f"Could not draw {n_train} + {n_validation} + {n_test} distinct prompts for task {task_args.task!r}."
        )
    empty = rows.select([])  # keeps the columns
    return task, DatasetDict({n: Dataset.from_list(drawn[n]) if drawn[n] else empty for n in SPLITS})
