"""trl_es.trainer.time_budget: the training clock and the learning-rate schedule laid out in time."""

import math
import time
from types import SimpleNamespace

import pytest
import torch

from trl_es.trainer.time_budget import TimeScheduleCallback, TrainingClock


def test_clock_stops_at_the_first_step_end_past_the_budget():
    clock = TrainingClock(budget_seconds=0.2)
    control, state = SimpleNamespace(should_training_stop=False), SimpleNamespace(global_step=0)
    clock.on_train_begin(None, state, control)
    while not control.should_training_stop:
        time.sleep(0.05)
        state.global_step += 1
        clock.on_step_end(None, state, control)
    assert 0.2 <= clock.training_seconds < 1.0 and clock.steps == state.global_step >= 4
    unlimited = TrainingClock(None)
    unlimited.on_train_begin(None, state, control := SimpleNamespace(should_training_stop=False))
    unlimited.on_step_end(None, state, control)
    assert not control.should_training_stop
    with pytest.raises(ValueError, match="budget_seconds"):
        TrainingClock(0)


def test_clock_evaluates_at_the_stop_when_asked():
    """evaluate_at_stop (``trl-es train --time_budget_minutes``): the stopping step also evaluates, so the accuracy
    curve ends on a held-out point; never with eval_strategy "no", and not before the budget is reached."""
    for eval_strategy, expected in (("steps", True), ("no", False)):
        clock = TrainingClock(budget_seconds=0.05, evaluate_at_stop=True)
        args, state = SimpleNamespace(eval_strategy=eval_strategy), SimpleNamespace(global_step=1)
        control = SimpleNamespace(should_training_stop=False, should_evaluate=False)
        clock.on_train_begin(args, state, control)
        clock.on_step_end(args, state, control)
        assert not control.should_training_stop and not control.should_evaluate  # before the budget
        time.sleep(0.06)
        state.global_step = 2
        clock.on_step_end(args, state, control)
        assert control.should_training_stop and control.should_evaluate is expected
    plain = TrainingClock(budget_seconds=0.01)  # default: stops, leaves evaluation to the trainer's eval_strategy
    control = SimpleNamespace(should_training_stop=False, should_evaluate=False)
    plain.on_train_begin(None, state, control)
    time.sleep(0.02)
    plain.on_step_end(SimpleNamespace(eval_strategy="steps"), state, control)
    assert control.should_training_stop and not control.should_evaluate


def test_time_schedule_by_hand():
    clock = TrainingClock(100.0)
    schedule = TimeScheduleCallback(clock, learning_rate=0.01, budget_seconds=100.0, decay_fraction=0.4)
    assert schedule.factor(0.0) == 1.0 and schedule.factor(60.0) == 1.0  # constant for the first 60%
    assert schedule.factor(80.0) == pytest.approx(0.5)  # halfway through the cosine: (1 + cos(pi / 2)) / 2
    assert schedule.factor(70.0) == pytest.approx((1 + math.cos(math.pi / 4)) / 2)
    assert schedule.factor(100.0) == pytest.approx(0.0, abs=1e-12) and schedule.factor(130.0) == pytest.approx(0.0)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.01)
    clock.training_seconds = 80.0
    schedule.on_step_begin(None, None, None, optimizer=optimizer)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.005)
    with pytest.raises(ValueError, match="decay_fraction"):
        TimeScheduleCallback(clock, 0.01, 100.0, 1.5)


def test_clock_says_when_it_cut_a_run():
    """stopped_early and describe_stop: True and a sentence with the step and max_steps when the budget stopped the
    run before max_steps; False and None when max_steps came first."""
    control = SimpleNamespace(should_training_stop=False, should_evaluate=False)
    clock = TrainingClock(budget_seconds=0.01)
    state = SimpleNamespace(global_step=0, max_steps=26)
    clock.on_train_begin(None, state, control)
    time.sleep(0.02)
    state.global_step = 18
    clock.on_step_end(SimpleNamespace(eval_strategy="no"), state, control)
    assert control.should_training_stop and clock.stopped_early
    assert clock.describe_stop().startswith("training was cut short by the time budget (0.000166667 min): it stopped "
                                            "at iteration 18 of max_steps=26 after")
    whole = TrainingClock(budget_seconds=0.01)
    state = SimpleNamespace(global_step=0, max_steps=3)
    whole.on_train_begin(None, state, control := SimpleNamespace(should_training_stop=False))
    time.sleep(0.02)
    state.global_step = 3  # the last step, past the budget too: not cut
    whole.on_step_end(SimpleNamespace(eval_strategy="no"), state, control)
    assert not whole.stopped_early and whole.describe_stop() is None


def test_progress_bar_in_minutes(tiny_llama, tokenizer, tmp_path, capsys):
    """show_progress_in_minutes: a run with a placeholder max_steps shows the budget in minutes and the steps done,
    not 'n/1000000' steps; with disable_tqdm nothing is swapped."""
    from datasets import Dataset
    from transformers.trainer_callback import ProgressCallback

    from trl_es import ESConfig, ESTrainer
    from trl_es.trainer.time_budget import TimeProgressCallback, show_progress_in_minutes

    clock = TrainingClock(budget_seconds=600.0)
    args = ESConfig(output_dir=str(tmp_path), max_steps=1_000_000, population_size=2, prompt_batch_size=2,
                    max_completion_length=2, noise_table_size=1 << 20, report_to=[], save_strategy="no",
                    logging_steps=1)
    data = Dataset.from_dict({"prompt": ["a", "b"]})
    trainer = ESTrainer(tiny_llama, lambda completions, **kw: [0.0] * len(completions), args=args,
                        train_dataset=data, processing_class=tokenizer, callbacks=[clock])

    class StopAfterTwo(TrainingClock):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= 2

    trainer.add_callback(StopAfterTwo())
    show_progress_in_minutes(trainer, 600.0, clock.elapsed_seconds)
    kinds = [type(c) for c in trainer.callback_handler.callbacks]
    assert ProgressCallback not in kinds and TimeProgressCallback in kinds
    trainer.train()
    err = capsys.readouterr().err
    assert "/10.0 min" in err and "step=2" in err and "1000000" not in err
    trainer.args.disable_tqdm = True
    show_progress_in_minutes(trainer, 600.0, clock.elapsed_seconds)  # no bar asked for: nothing changes
    assert [type(c) for c in trainer.callback_handler.callbacks] == kinds
    with pytest.raises(ValueError, match="budget_seconds must be > 0, got 0"):
        TimeProgressCallback(0, clock.elapsed_seconds)
