"""Training under a wall-clock budget: a clock that stops the Trainer, and a learning-rate schedule laid out in time.

Both are ``transformers.TrainerCallback``s, for any trainer (``ESTrainer``, TRL's ``GRPOTrainer``, ...). Comparing
methods "at the same wall-clock budget of training" needs a clock that every method reads the same way:
:class:`TrainingClock` starts at ``on_train_begin`` (after model loading and trainer construction) and is checked at
every step end; with several processes it is the slowest process's clock (a ``torch.distributed`` max), so all of
them stop at the same step. ``trl-es train --time_budget_minutes`` stops on this clock too, and says so when it cut
a run short (:attr:`TrainingClock.stopped_early`). :class:`TimeProgressCallback` replaces the Trainer's step bar of a
run that only the budget ends (its ``max_steps`` a placeholder) with a bar in minutes.
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
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


class TrainingClock(TrainerCallback):
    """Measures training wall-clock time and stops training once it reaches ``budget_seconds``.

    The clock starts at ``on_train_begin`` and is read at every ``on_step_end``; the step that reaches the budget is
    the last one (so a run overshoots by less than one step). Several processes agree on the clock (the maximum).

    Args:
        budget_seconds (`float` or `None`): Stop once this much training time has passed; ``None`` = never (the
            trainer's ``max_steps`` ends the run, the clock only measures).
        evaluate_at_stop (`bool`, defaults to `False`): At the step that reaches the budget, also evaluate (when
            ``args.eval_strategy`` is not ``"no"``), so an accuracy curve ends on a held-out point at the stop
            (``trl-es train --time_budget_minutes`` does).

    Attributes:
        training_seconds (`float`): Training time up to the last step end.
        steps (`int`): Steps done (``state.global_step`` at the last step end).
        stopped_early (`bool`): ``True`` when the budget stopped training before ``max_steps`` (the run is cut
            short: its last step is :attr:`steps`, not ``max_steps``).
        max_steps (`int` or `None`): The run's ``state.max_steps`` (set at ``on_train_begin``).

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
        self._start = time.monotonic()
        self.max_steps = getattr(state, "max_steps", None)
        self.stopped_early = False

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
            self.stopped_early = self.max_steps is None or state.global_step < self.max_steps
            if self.evaluate_at_stop:
                control.should_evaluate = args.eval_strategy != "no"  # end on a held-out point for the curve


class TimeScheduleCallback(TrainerCallback):
    """A learning-rate schedule laid out over a wall-clock budget: ``learning_rate`` until
    ``(1 - decay_fraction) * budget_seconds`` of training time, then a cosine decay to 0 at the budget
    (warmup-stable-decay in time instead of steps, without warmup).

    At every step begin it sets every optimizer group's ``lr`` (overriding the Trainer's scheduler, which should be
    ``"constant"``) from ``clock.training_seconds``. ``ESTrainer`` reads its ES step size ``alpha`` from the same
    optimizer group, so this schedules ES too.

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
        progress = min(1.0, (seconds - start) / (self.budget_seconds - start))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is None:
            return
        learning_rate = self.learning_rate * self.factor(self.clock.training_seconds)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate


class TimeProgressCallback(ProgressCallback):
    """The Trainer's progress bar in minutes of the budget instead of steps, for a run that only the budget ends.

    Such a run's ``max_steps`` is a placeholder (e.g. 1,000,000), so the step bar would read ``12/1000000`` with an
    ETA of thousands of hours. This bar's total is the budget in minutes, its position the training time read at each
    step end, its postfix the steps done; the Trainer's log lines are written as by ``ProgressCallback``. Install it
    with :func:`show_progress_in_minutes`.

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
        if state.is_world_process_zero:
            bar_format = "{l_bar}{bar}| {n:.1f}/{total:.1f} min [{elapsed}<{remaining}{postfix}]"
            self.training_bar = tqdm(total=round(self.budget_seconds / 60.0, 2), unit="min", dynamic_ncols=True,
                                     bar_format=bar_format)
        self.current_step = 0

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None:
            minutes = min(self.training_seconds() / 60.0, self.training_bar.total)
            self.training_bar.update(minutes - self.training_bar.n)
            self.training_bar.set_postfix(step=state.global_step, refresh=True)
        self.current_step = state.global_step


def show_progress_in_minutes(trainer, budget_seconds: float, training_seconds) -> None:
    """Give ``trainer`` a progress bar in minutes of the budget (:class:`TimeProgressCallback`) in place of its step
    bar; nothing when ``args.disable_tqdm`` (the Trainer then shows no bar either).

    Args:
        trainer (`transformers.Trainer`): Any trainer (``ESTrainer``, ``GRPOTrainer``, ...), before ``train()``.
        budget_seconds (`float`): The budget, ``> 0``.
        training_seconds (`Callable[[], float]`): Training time so far in seconds, read at every step end.

    Raises:
        ValueError: if ``budget_seconds`` is not ``> 0``.
    """
    if trainer.args.disable_tqdm:
        return
    callback = TimeProgressCallback(budget_seconds, training_seconds)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(callback)
