"""Training under a wall-clock budget: a clock that stops the Trainer, a learning-rate schedule laid out in time,
and a progress bar in minutes.

``transformers.TrainerCallback``s for any trainer (``ESTrainer``, ``GRPOTrainer``, ...), so methods compared "at the
same wall-clock budget" read one clock; ``trl-es train --time_budget_minutes`` uses them.
"""

from __future__ import annotations

import math
import time

from tqdm.auto import tqdm
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback


__all__ = ["TimeProgressCallback", "TimeScheduleCallback", "TrainingClock", "show_progress_in_minutes"]


def _max_over_processes(value: float) -> float:
    """``value`` maximized over the ``torch.distributed`` processes (itself without a process group)."""
    # the slowest process's clock: every process stops at the same step
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


class TrainingClock(TrainerCallback):
    """Measures training wall-clock seconds from ``on_train_begin`` and stops training at the step end that reaches
    ``budget_seconds`` (overshooting by less than a step); the processes agree on the slowest clock.

    Args:
        budget_seconds (`float` or `None`): The budget, ``> 0``; ``None``: the clock only measures.
        evaluate_at_stop (`bool`, defaults to `False`): Also evaluate at the stopping step (unless
            ``eval_strategy="no"``).

    Attributes:
        training_seconds (`float`): Training time up to the last step end.
        steps (`int`): ``state.global_step`` at the last step end.
        stopped_early (`bool`): The budget stopped training before ``max_steps``.
        max_steps (`int` or `None`): The run's ``state.max_steps``.

    Raises:
        ValueError: if ``budget_seconds`` is not ``None`` and not ``> 0``.
    """

    def __init__(self, budget_seconds: float | None = None, evaluate_at_stop: bool = False):
        if budget_seconds is not None and not budget_seconds > 0:
            raise ValueError(f"budget_seconds must be > 0 or None, got {budget_seconds}.")
        self.budget_seconds = budget_seconds
        self.evaluate_at_stop = evaluate_at_stop
        self.training_seconds = 0.0
        self.steps = 0
        self.stopped_early = False
        self.max_steps = None
        self._start = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = time.monotonic()  # after model loading and trainer construction
        self.max_steps = getattr(state, "max_steps", None)
        self.stopped_early = False  # a second train() starts afresh

    def elapsed_seconds(self) -> float:
        """This process's training time so far, in seconds (0 before ``on_train_begin``; no collective)."""
        return 0.0 if self._start is None else time.monotonic() - self._start

    def describe_stop(self) -> str | None:
        """A sentence saying that the budget cut the run, at which step of how many; ``None`` if it did not."""
        if not self.stopped_early:
            return None
        return (f"training was cut short by the time budget ({self.budget_seconds / 60:g} min): it stopped at "
                f"iteration {self.steps} of max_steps={self.max_steps} after {self.training_seconds / 60:.1f} min")

    def on_step_end(self, args, state, control, **kwargs):
        self.training_seconds = _max_over_processes(time.monotonic() - self._start)
        self.steps = state.global_step
        if self.budget_seconds is not None and self.training_seconds >= self.budget_seconds:
            control.should_training_stop = True
            self.stopped_early = self.max_steps is None or state.global_step < self.max_steps  # cut short
            if self.evaluate_at_stop:
                control.should_evaluate = args.eval_strategy != "no"  # end on a held-out point for the curve


class TimeScheduleCallback(TrainerCallback):
    """Warmup-stable-decay in wall-clock time, without warmup: ``learning_rate`` until ``(1 - decay_fraction) *
    budget_seconds`` of training, then a cosine decay to 0 at the budget; the ES step size ``alpha`` too.

    Args:
        clock (`TrainingClock`): The run's clock.
        learning_rate (`float`): The constant part's learning rate.
        budget_seconds (`float`): The budget the schedule ends at, ``> 0``.
        decay_fraction (`float`): The last part of the budget the cosine decay spans, in ``[0, 1]``.

    Raises:
        ValueError: for ``decay_fraction`` outside ``[0, 1]`` or ``budget_seconds <= 0``.
    """

    def __init__(self, clock: TrainingClock, learning_rate: float, budget_seconds: float, decay_fraction: float):
        if not 0 <= decay_fraction <= 1:
            raise ValueError(f"decay_fraction must be in [0, 1], got {decay_fraction}.")
        if not budget_seconds > 0:
            raise ValueError(f"budget_seconds must be > 0, got {budget_seconds}.")
        self.clock, self.learning_rate = clock, float(learning_rate)
        self.budget_seconds, self.decay_fraction = float(budget_seconds), float(decay_fraction)

    def factor(self, seconds: float) -> float:
        """The learning-rate multiplier after ``seconds`` of training: 1, then ``(1 + cos(pi * progress)) / 2``."""
        start = (1.0 - self.decay_fraction) * self.budget_seconds
        if seconds <= start or self.decay_fraction == 0:
            return 1.0
        progress = min(1.0, (seconds - start) / (self.budget_seconds - start))  # 0 at the decay's start, 1 at the end
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is None:  # nothing to schedule
            return
        learning_rate = self.learning_rate * self.factor(self.clock.training_seconds)
        # over the Trainer's scheduler (keep it "constant"); ESTrainer reads alpha from these groups
        for group in optimizer.param_groups:
            group["lr"] = learning_rate


class TimeProgressCallback(ProgressCallback):
    """The Trainer's progress bar in minutes of the budget, steps done as its postfix, for a run that only the budget
    ends (its ``max_steps`` a placeholder); installed by :func:`show_progress_in_minutes`.

    Args:
        budget_seconds (`float`): The budget, ``> 0``.
        training_seconds (`Callable[[], float]`): Training time so far in seconds (e.g.
            :meth:`TrainingClock.elapsed_seconds`), read at every step end.

    Raises:
        ValueError: if ``budget_seconds`` is not ``> 0``.
    """

    def __init__(self, budget_seconds: float, training_seconds):
        super().__init__()
        if not budget_seconds > 0:
            raise ValueError(f"budget_seconds must be > 0, got {budget_seconds}.")
        self.budget_seconds, self.training_seconds = float(budget_seconds), training_seconds

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:  # a step bar would read 12/1000000 with an ETA of thousands of hours
            bar_format = "{l_bar}{bar}| {n:.1f}/{total:.1f} min [{elapsed}<{remaining}{postfix}]"
            self.training_bar = tqdm(total=round(self.budget_seconds / 60.0, 2), unit="min", dynamic_ncols=True,
                                     bar_format=bar_format)
        self.current_step = 0  # as ProgressCallback keeps it

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None:
            minutes = min(self.training_seconds() / 60.0, self.training_bar.total)
            self.training_bar.update(minutes - self.training_bar.n)  # tqdm takes increments
            self.training_bar.set_postfix(step=state.global_step, refresh=True)
        self.current_step = state.global_step


def show_progress_in_minutes(trainer, budget_seconds: float, training_seconds) -> None:
    """Replace ``trainer``'s step bar (before ``train()``) with a :class:`TimeProgressCallback` of the same arguments.

    Raises:
        ValueError: if ``budget_seconds`` is not ``> 0``.
    """
    if trainer.args.disable_tqdm:  # the Trainer shows no bar either
        return
    callback = TimeProgressCallback(budget_seconds, training_seconds)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(callback)
