"""GRPO's completion logs for ES (``log_completions``): every member's prompts, completions and rewards of the last
iteration (``population_size x prompt_batch_size x num_generations`` rows), printed with rich, written as parquet,
logged to wandb / trackio and pushed to a Hub dataset repo, as GRPOTrainer does.

Columns: ``step``, ``prompt``, ``completion`` (as the reward functions saw it), one per reward function (``None``
where it returned ``None``), the ``log_extra`` columns, ``advantage`` (the member's shaped coefficient ``z_i``, the
same for all its completions) and ``member`` (its population index).
"""

from __future__ import annotations

import math
import os
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from ...rollout import RolloutResult


__all__ = ["CompletionLog", "empty_logs"]

COMPLETIONS_FOLDER = "completions"


def _value(x: float) -> float | None:  # NaN (a None reward) back to None
    return None if math.isnan(x) else float(x)


def empty_logs() -> dict[str, Any]:
    """An empty table in GRPOTrainer's ``trainer._logs`` layout (plus ES's ``member`` and ``step``)."""
    return {"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [], "member": [],
            "extra": defaultdict(list), "step": None}


class CompletionLog:
    """The completion table of the last ES iteration: per rollout call :meth:`log_extra_for_call` and :meth:`add_call`,
    per iteration :meth:`finish_iteration` (after shaping), at a log :meth:`write`.

    Args:
        reward_names (`Sequence[str]`): The reward functions' names (one column each).
        output_dir (`str`): The run's output folder; parquet files go to ``output_dir/completions``.
        num_completions_to_print (`int` or `None`): Rows printed (``None``: all; ``0``: none, as in GRPO).
        log_unique_prompts (`bool`): One row per distinct prompt in the tracker tables.
        report_to (`Sequence[str]`): The trackers; ``"wandb"`` (with an active run) and ``"trackio"`` get a table.
        hub_repo (`str`, *optional*): Hub dataset repo the parquet files are pushed to.
    """

    def __init__(self, reward_names: Sequence[str], output_dir: str, num_completions_to_print: int | None = None,
                 log_unique_prompts: bool = False, report_to: Sequence[str] = (), hub_repo: str | None = None):
        self.reward_names = list(reward_names)
        self.folder = os.path.join(output_dir, COMPLETIONS_FOLDER)
        self.num_completions_to_print = num_completions_to_print
        self.log_unique_prompts = log_unique_prompts
        self.report_to = list(report_to or [])
        self.hub_repo = hub_repo
        self.commit_scheduler = None
        self.logs: dict[str, Any] = empty_logs()  # GRPO's trainer._logs layout
        self._rows: list[dict] = []  # this process's rows of the iteration in progress
        self._pending: dict[str, list] = {}
        self._written_step: int | None = None  # the step of the last table written

    # ------------------------------------------------------------------ recording
    def log_extra_for_call(self) -> Callable[[str, Sequence], None]:
        """GRPO's ``log_extra(column, values)`` for one rollout call, ``values`` one per completion of the call."""
        pending: dict[str, list] = {}  # a buffer per call: calls may run concurrently (several vLLM servers)

        def log_extra(column: str, values: Sequence) -> None:
            pending[str(column)] = list(values)

        log_extra.pending = pending
        self._pending = pending
        return log_extra

    def add_call(self, members: Sequence[int], result: RolloutResult, log_extra: Callable | None = None) -> None:
        """Record one rollout call of ``members`` (population indices, one equal consecutive block of completions each);
        ``log_extra`` is the call's :meth:`log_extra_for_call`, default the last one made.

        Raises:
            ValueError: if a ``log_extra`` column does not hold one value per completion of the call (naming it).
        """
        pending = self._pending if log_extra is None else log_extra.pending
        total = len(result.reward_completions)
        for column, values in pending.items():
            if len(values) != total:
                raise ValueError(f"log_extra({column!r}, values) got {len(values)} values; the call's reward "
                                 f"functions scored {total} completions: give one value per completion.")
        width = total // max(1, len(members))  # one equal block of completions per stacked member
        rewards = result.rewards_per_func.tolist()
        for k, member in enumerate(members):
            for i in range(k * width, (k + 1) * width):
                self._rows.append({
                    "member": int(member), "prompt": result.prompts[i], "completion": result.reward_completions[i],
                    "rewards": [_value(r) for r in rewards[i]],
                    "extra": {column: values[i] for column, values in pending.items()},
                })
        self._pending = {}

    def finish_iteration(self, step: int, coefficients: Sequence[float],
                         gather: Callable[[list], list] | None = None, is_main_process: bool = True) -> None:
        """Make the iteration's rows the table (main process), ``advantage`` the member's ``coefficients``; ``gather``
        maps this process's rows to every process's in rank order (``None`` on one process)."""
        rows, self._rows = self._rows, []
        if gather is not None:  # text travels between processes only with log_completions=True
            rows = gather(rows)
        if not is_main_process:
            return
        # by member, stable: the same table for any number of processes
        rows = sorted(rows, key=lambda row: row["member"])
        logs = empty_logs()
        logs["step"] = int(step)
        columns = sorted({column for row in rows for column in row["extra"]})  # None where a call did not log one
        for row in rows:
            logs["prompt"].append(row["prompt"])
            logs["completion"].append(row["completion"])
            for name, value in zip(self.reward_names, row["rewards"], strict=True):
                logs["rewards"][name].append(value)
            logs["advantages"].append(float(coefficients[row["member"]]))
            logs["member"].append(row["member"])
            for column in columns:
                logs["extra"][column].append(row["extra"].get(column))
        self.logs = logs

    # ------------------------------------------------------------------ output
    def table(self) -> dict[str, list]:
        """The table's columns: ``step``, ``prompt``, ``completion``, the reward names, the extra columns,
        ``advantage``, ``member``."""
        logs = self.logs
        n = len(logs["prompt"])
        return {"step": [logs["step"]] * n, "prompt": list(logs["prompt"]), "completion": list(logs["completion"]),
                **{name: list(values) for name, values in logs["rewards"].items()},
                **{column: list(values) for column, values in logs["extra"].items()},
                "advantage": list(logs["advantages"]), "member": list(logs["member"])}

    def start_hub_upload(self, hub_private_repo: bool | None = None, hub_model_id: str | None = None) -> None:
        """Main process: create the Hub dataset repo with TRL's card and push ``output_dir/completions`` every 2 minutes
        (``CommitScheduler``), as GRPOTrainer."""
        if self.hub_repo is None:
            return
        import importlib.resources  # TRL ships the card template

        from huggingface_hub import CommitScheduler, DatasetCard, DatasetCardData, create_repo

        os.makedirs(self.folder, exist_ok=True)
        create_repo(self.hub_repo, private=hub_private_repo, repo_type="dataset", exist_ok=True)
        template = importlib.resources.files("trl").joinpath("templates/completions_dataset_card.md")
        card = DatasetCard.from_template(
            card_data=DatasetCardData(pretty_name="TRL Completion logs", tags=["trl", "trl-logs", "completions",
                                                                              "trl-es"]),
            template_path=str(template), repo_id=self.hub_repo, hub_model_id=hub_model_id,
        )
        card.push_to_hub(self.hub_repo)
        self.commit_scheduler = CommitScheduler(repo_id=self.hub_repo, repo_type="dataset", folder_path=self.folder,
                                                every=2, allow_patterns=["*.parquet"])

    def write(self) -> str | None:
        """Main process, at a log: print the table, write ``output_dir/completions/completions_{step:05d}.parquet`` and
        log it to the trackers, once per iteration.

        Returns:
            `str` or `None`: The parquet path, or ``None`` when there was nothing new to write.
        """
        logs = self.logs
        if not logs["prompt"] or logs["step"] == self._written_step:  # each iteration's table once
            return None
        self._print()
        import pandas as pd

        frame = pd.DataFrame(self.table())
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"completions_{logs['step']:05d}.parquet")
        frame.to_parquet(path + ".tmp")  # then renamed: a reader never sees half a file
        os.replace(path + ".tmp", path)
        self._written_step = logs["step"]
        for backend in self._trackers():
            # str: a conversational prompt (a list of dicts) is not hashable
            table = frame[~frame["prompt"].astype(str).duplicated()] if self.log_unique_prompts else frame
            backend.log({"completions": backend.Table(dataframe=table)})
        return path

    def _print(self) -> None:
        from transformers.utils import is_rich_available

        if not is_rich_available():
            return
        from trl.trainer.utils import print_prompt_completions_sample

        if self.num_completions_to_print == 0:
            return  # GRPO's meaning (print_prompt_completions_sample with num_samples=0): print none
        logs = self.logs
        indices = list(range(len(logs["prompt"])))
        if self.num_completions_to_print is not None and self.num_completions_to_print < len(indices):
            # a sample of our own (seeded by the step): TRL's sampling would draw from Python's global RNG
            indices = sorted(random.Random(logs["step"]).sample(indices, self.num_completions_to_print))
        pick = lambda values: [values[i] for i in indices]  # noqa: E731
        print_prompt_completions_sample(
            pick(logs["prompt"]), pick(logs["completion"]),
            {name: [math.nan if v is None else v for v in pick(values)] for name, values in logs["rewards"].items()},
            pick(logs["advantages"]),
            logs["step"], None, extra={"member": pick(logs["member"]),
                                       **{c: pick(v) for c, v in logs["extra"].items()}},
        )

    def _trackers(self) -> list:
        backends = []
        if "wandb" in self.report_to:  # only with an active run, as GRPO
            try:
                import wandb
            except ImportError:
                wandb = None
            if wandb is not None and wandb.run is not None:
                backends.append(wandb)
        if "trackio" in self.report_to:
            try:
                import trackio
            except ImportError:
                trackio = None
            if trackio is not None:
                backends.append(trackio)
        return backends
