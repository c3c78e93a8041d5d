"""sigma="auto" and the collapse guard (trl_es.es.autosigma, trl_es.es.guard, ESTrainer): the search and the guard's
decisions on made-up sequences, and on tiny models the seed-log records that keep replay and resume bitwise."""

import json
import math
import os

import pytest
import torch
from datasets import Dataset
from tiny import build_llama

from trl_es import ESConfig, ESTrainer, replay
from trl_es.es import SEED_LOG_NAME
from trl_es.es.autosigma import SigmaSearch, differing_completions, differing_rewards
from trl_es.es.guard import CollapseGuard, mean_and_se


DEFAULT = object()  # es_args(field=DEFAULT): ESConfig's default


def es_args(tmp_path, **kwargs):
    # sigma_calibration_prompts=0: calibrations on the iteration's batch only (fast); its default (48) in its own tests
    defaults = dict(output_dir=str(tmp_path / "out"), max_steps=3, population_size=4, prompt_batch_size=4,
                    max_completion_length=6, sigma="auto", learning_rate=0.02, report_to=[], save_strategy="no",
                    noise_table_size=1 << 20, disable_tqdm=True, seed=0, logging_steps=1, sigma_calibration_prompts=0)
    defaults.update(kwargs)
    return ESConfig(**{name: value for name, value in defaults.items() if value is not DEFAULT})


def prompts(n=16):
    return Dataset.from_dict({"prompt": [f"Write: {i}" for i in range(n)]})


def mean_code(completions, **kwargs):
    return [sum(map(ord, c)) / (128 * max(1, len(c))) for c in completions]


def collapsing(at):
    """mean_code, minus 1 from iteration ``at`` on: a made-up collapse the weights cannot cause or undo."""
    def reward(completions, trainer_state=None, **kwargs):
        drop = 1.0 if trainer_state is not None and trainer_state.global_step + 1 >= at else 0.0
        return [r - drop for r in mean_code(completions)]
    reward.__name__ = "collapsing"
    return reward


def prompt_number(completions, prompts, **kwargs):
    """A flat run: the reward is the prompt's number mod 5 / 5, whatever the weights (batches differ in mean)."""
    return [int(p.rsplit(" ", 1)[1]) % 5 / 5 for p in prompts]


def snapshot(model):
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def records(folder):
    with open(os.path.join(folder, SEED_LOG_NAME)) as f:
        lines = [json.loads(line) for line in f]
    return lines[0], lines[1:]


# ---------------------------------------------------------------------------------------------- the search
@pytest.mark.parametrize("scale", [0.005, 0.0003])
def test_search_finds_the_sigma_of_the_target_effect(scale):
    """A made-up effect 1 - exp(-sigma / scale), monotone: the chosen sigma has an effect near the target."""
    def effect(sigma):
        return round(48 * (1 - math.exp(-sigma / scale))) / 48  # counted over 48 completions
    search = SigmaSearch(0.5)
    while (sigma := search.next_sigma()) is not None:
        search.tell(sigma, effect(sigma))
    assert len(search.probes) <= 8
    assert abs(effect(search.choice()) - 0.5) <= 0.07
    assert search.probes[0][0] == 1e-3


def test_search_without_a_bracket_takes_the_nearest_probe():
    search = SigmaSearch(0.5)
    while (sigma := search.next_sigma()) is not None:
        search.tell(sigma, 0.0)  # nothing ever changes: sigma rises until SIGMA_RANGE's end
    assert search.choice() == max(s for s, _ in search.probes)
    assert search.choice() <= 1.0


def test_differing_rewards_counts_rows_and_nan_is_equal_to_nan():
    nan = float("nan")
    assert differing_rewards([1.0, 0.0, nan], [[1.0, 1.0, nan], [0.0, 0.0, 0.5]]) == (3, 6)
    with pytest.raises(ValueError, match="a member has 1 rewards, the center 2"):
        differing_rewards([1.0, 0.0], [[1.0]])


def test_differing_completions_counts_rows():
    assert differing_completions([[1, 2], [3]], [[[1, 2], [3]], [[1, 2], [4]]]) == (1, 4)
    assert differing_completions([[5]], [[[6]], [[6]], [[5]]]) == (2, 3)
    with pytest.raises(ValueError, match="completions"):
        differing_completions([[1]], [[[1], [2]]])


# ---------------------------------------------------------------------------------------------- the guard
def guard_run(means, se=0.01, **settings):
    """Feed ``means`` to the guard as a run would; returns the iterations (1-based) whose record is a rollback."""
    guard, fired, log = CollapseGuard(**settings), [], []
    for t, mean in enumerate(means, 1):
        if guard.observe(t - 1, mean, se):
            guard.rollback([{"members": [[t, 1], [t, -1]], "coefficients": [1.0, -1.0], "learning_rate": 0.1}] * t)
            fired.append(t)
            log.append({"step": t, "fitness_mean": mean, "fitness_se": se, "rollback_to": guard.best_state})
        else:
            guard.applied(t)
            log.append({"step": t, "fitness_mean": mean, "fitness_se": se})
    rebuilt = CollapseGuard.from_records(log, **settings)
    assert (rebuilt.chain, rebuilt.rollbacks, rebuilt.best) == (guard.chain, guard.rollbacks, guard.best)
    return fired, guard


def test_guard_fires_on_a_collapse_and_rolls_back_to_the_best_state():
    means = [0.3, 0.4, 0.5, 0.6, 0.2, 0.1, 0.1, 0.6]
    fired, guard = guard_run(means)
    assert fired == [7]  # iterations 5, 6, 7 measure the collapse: the 7th completes it (patience 3)
    assert guard.best_state == 3  # iteration 4 measured the weights after step 3
    assert guard.chain == [1, 2, 3, 8] and guard.rollbacks == 1 and guard.alpha_scale == 0.5
    assert guard_run(means, patience=2)[0] == [6]


def flat_runs(runs=200, iterations=26, prompts=12, p=0.4):
    """Made-up flat runs: each iteration's mean of ``prompts`` binary rewards at ``p``, and its standard error."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(runs):
        means = (torch.rand(iterations, prompts, generator=generator) < p).double().mean(1)
        yield means.tolist(), (means * (1 - means) / prompts).sqrt().tolist()


def test_guard_does_not_fire_on_flat_noisy_runs():
    """200 runs of the main job's length (26 iterations, 12 prompts): the default guard fires on under 5% of them
    (the best so far is the max of noisy batch means); a 1-standard-error threshold fires on most."""
    def fired(threshold):
        count = 0
        for means, ses in flat_runs():
            guard = CollapseGuard(threshold=threshold)
            hits = 0
            for t, (mean, se) in enumerate(zip(means, ses, strict=True)):
                if guard.observe(t, mean, se):
                    hits += 1
                    guard._roll_back()
                else:
                    guard.applied(t + 1)
            count += hits > 0
        return count
    assert fired(3.0) < 10
    assert fired(1.0) > 150
    assert guard_run([0.5] * 30)[0] == []  # exactly flat


def test_guard_rollback_undoes_the_steps_since_the_best():
    guard = CollapseGuard(patience=1)
    logged = [{"members": [[7, 1], [7, -1]], "coefficients": [0.5, -0.5], "learning_rate": 0.2},
              {"members": [[9, 1], [9, -1]], "coefficients": [1.0, -1.0], "learning_rate": 0.4}]
    assert not guard.observe(0, 1.0, 0.0)
    guard.applied(1)
    assert not guard.observe(1, 1.0, 0.0)  # not above the best: no new best, not a drop
    guard.applied(2)
    assert guard.observe(2, 0.0, 0.0)
    rollback = guard.rollback(logged)
    assert rollback.to_state == 0 and rollback.undone == [2, 1]
    assert rollback.members == [[9, 1], [9, -1], [7, 1], [7, -1]]
    assert rollback.coefficients == [-0.2, 0.2, -0.05, 0.05] and rollback.learning_rate == 4.0


def test_mean_and_se():
    mean, se = mean_and_se(3.0, 3.0, 6.0, 2)  # rewards 1,1,1,0,0,0 over 2 members: 3 completions each
    assert mean == 0.5 and se == pytest.approx(math.sqrt(0.25 / 3))
    assert all(math.isnan(v) for v in mean_and_se(0.0, 0.0, 0.0, 2))


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"sigma": "bogus"}, r"sigma must be > 0 \(a number\) or 'auto', got 'bogus'"),
    ({"sigma": -0.01}, r"sigma must be > 0 \(a number\) or 'auto', got -0.01"),
    ({"sigma": None}, r"sigma must be > 0 \(a number\) or 'auto', got None"),
    ({"sigma_target": 1.0}, r"sigma_target must be in \(0, 1\)"),
    ({"sigma_adapt_steps": -1}, "sigma_adapt_steps must be an integer >= 0"),
    ({"sigma_adapt_steps": 2, "sigma": 0.01}, "sigma_adapt_steps=2 needs sigma='auto'"),
    ({"sigma_calibration_prompts": -1}, "sigma_calibration_prompts must be an integer >= 0"),
    ({"collapse_guard_threshold": -1.0}, "collapse_guard_threshold must be > 0"),
    ({"collapse_guard_patience": 0}, "collapse_guard_patience must be an integer >= 1"),
    ({"collapse_guard_alpha_factor": 0.0}, r"collapse_guard_alpha_factor must be in \(0, 1\]"),
    ({"collapse_guard": True, "awd_lambda": 0.1}, "collapse_guard=True needs awd_lambda=0"),
    ({"collapse_guard": True, "es_optimizer": "torch"}, "collapse_guard=True needs es_optimizer='es'"),
])
def test_bad_settings_name_the_field(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        es_args(tmp_path, **kwargs)


def test_numeric_sigma_string_is_a_number(tmp_path):
    assert es_args(tmp_path, sigma="0.005").sigma == 0.005
    assert es_args(tmp_path).sigma == "auto"


# ---------------------------------------------------------------------------------------------- the trainer
@pytest.mark.parametrize("backend", ["sequential", "batched_lowrank"])
def test_auto_sigma_is_logged_and_replays_bitwise(tmp_path, tokenizer, backend):
    model = build_llama(tokenizer)
    base = snapshot(model)
    args = es_args(tmp_path, population_backend=backend, sigma_calibration_prompts=DEFAULT)
    trainer = ESTrainer(model, mean_code, args=args, train_dataset=prompts(), processing_class=tokenizer)
    trainer.train()
    header, logged = records(args.output_dir)
    assert header["sigma"] == "auto" and header["run_settings"]["sigma_target"] == 0.48
    assert header["run_settings"]["sigma_calibration_prompts"] == 48  # the batch and all 16 prompts (a warning)
    sigmas = {r["sigma"] for r in logged}
    assert len(sigmas) == 1 and trainer.strategy.sigma == sigmas.pop()
    first = logged[0]
    assert 3 <= len(first["sigma_probes"]) <= 8 and 0 <= first["sigma_effect"] <= 1
    assert "sigma_probes" not in logged[1]
    history = [h for h in trainer.state.log_history if "sigma" in h]
    assert [h["sigma"] for h in history] == [r["sigma"] for r in logged]
    assert history[0]["sigma/effect"] == first["sigma_effect"]
    rebuilt = build_llama(tokenizer)
    assert_bitwise(snapshot(rebuilt), base)
    replay(rebuilt, args.output_dir)
    assert_bitwise(snapshot(rebuilt), snapshot(trainer.model))


def test_auto_sigma_resume_reads_sigma_from_the_log(tmp_path, tokenizer):
    full = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path / "full", max_steps=4),
                     train_dataset=prompts(), processing_class=tokenizer)
    full.train()
    args = es_args(tmp_path / "resumed", max_steps=4, save_strategy="steps", save_steps=2)
    ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=prompts(),
              processing_class=tokenizer).train()
    resumed = ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=prompts(),
                        processing_class=tokenizer)
    resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-2"))
    assert_bitwise(snapshot(resumed.model), snapshot(full.model))
    assert resumed.seed_log.records == full.seed_log.records
    after = [h for h in resumed.state.log_history if h.get("step", 0) > 2 and "sigma" in h]
    assert len(after) == 2 and not any("sigma/effect" in h for h in after)  # not calibrated again


@pytest.mark.parametrize("backend", ["sequential", "batched_lowrank"])
def test_sigma_adapt_steps_recalibrates_from_the_sigma_in_use_and_resumes_bitwise(tmp_path, tokenizer, backend):
    common = dict(max_steps=5, sigma_adapt_steps=2, population_backend=backend)
    full = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path / "full", **common),
                     train_dataset=prompts(), processing_class=tokenizer)
    full.train()
    header, logged = records(full.args.output_dir)
    assert header["run_settings"]["sigma_adapt_steps"] == 2
    assert [r["step"] for r in logged if "sigma_probes" in r] == [1, 3, 5]  # iterations 1, 3, 5
    assert logged[0]["sigma_probes"][0][0] == 1e-3  # the first search starts at the paper's sigma,
    for k in (2, 4):  # a re-calibration at the sigma the previous iterations used
        assert logged[k]["sigma_probes"][0][0] == logged[k - 1]["sigma"]
    assert logged[1]["sigma"] == logged[0]["sigma"] and logged[3]["sigma"] == logged[2]["sigma"]
    effects = [h["sigma/effect"] for h in full.state.log_history if "sigma/effect" in h]
    assert effects == [r["sigma_effect"] for r in logged if "sigma_probes" in r]
    rebuilt = replay(build_llama(tokenizer), full.args.output_dir)
    assert_bitwise(snapshot(rebuilt), snapshot(full.model))
    # resumed from checkpoint-2, the run re-calibrates at iteration 3 as the uninterrupted one did
    args = es_args(tmp_path / "resumed", save_strategy="steps", save_steps=2, **common)
    ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=prompts(), processing_class=tokenizer).train()
    resumed = ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=prompts(),
                        processing_class=tokenizer)
    resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-2"))
    assert resumed.seed_log.records == full.seed_log.records
    assert_bitwise(snapshot(resumed.model), snapshot(full.model))
    # another period would not continue this run: refused, naming the field
    other = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path / "resumed", **{
        **common, "sigma_adapt_steps": 3, "save_strategy": "steps", "save_steps": 2}), train_dataset=prompts(),
        processing_class=tokenizer)
    with pytest.raises(ValueError, match=r"sigma_adapt_steps \(checkpoint: 2, this run: 3\)"):
        other.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-2"))


def test_sigma_calibration_prompts_pools_drawn_prompts_and_resumes_bitwise(tmp_path, tokenizer, caplog):
    """sigma_calibration_prompts=12: each calibration rolls out its batch (4) and 8 prompts drawn by
    default_rng([seed, step]); the same on resume, and another value is refused there."""
    import numpy as np

    dataset = prompts()
    seen = []  # the prompts of every reward call in the first iteration (the calibration's and the members')

    def recorded(completions, prompts, trainer_state=None, **kwargs):
        if trainer_state.global_step == 0:
            seen.extend(prompts)
        return mean_code(completions)

    common = dict(max_steps=4, sigma_adapt_steps=2, sigma_calibration_prompts=12, save_strategy="steps",
                  save_steps=2)
    args = es_args(tmp_path / "full", **common)
    full = ESTrainer(build_llama(tokenizer), recorded, args=args, train_dataset=dataset, processing_class=tokenizer)
    with caplog.at_level("WARNING"):
        full.train()
    assert "greedy completions on 12 prompts" in caplog.text
    drawn = {dataset[int(i)]["prompt"] for i in np.random.default_rng([0, 0]).choice(16, size=8, replace=False)}
    batch = set(seen) - drawn  # the first batch (4 prompts) may share prompts with the drawn 8
    assert drawn <= set(seen) and len(set(seen)) <= 12 and len(batch) <= 4
    header, logged = records(args.output_dir)
    assert header["run_settings"]["sigma_calibration_prompts"] == 12
    assert [r["step"] for r in logged if "sigma_probes" in r] == [1, 3]
    # the calibration at iteration 3 draws its own prompts: default_rng([seed, 2])
    assert full.stability.calibration_rows([], 2) == [dataset[int(i)] for i in
                                                      np.random.default_rng([0, 2]).choice(16, 8, replace=False)]
    rebuilt = replay(build_llama(tokenizer), args.output_dir)
    assert_bitwise(snapshot(rebuilt), snapshot(full.model))
    resumed = ESTrainer(build_llama(tokenizer), recorded, args=es_args(tmp_path / "full", **common),
                        train_dataset=dataset, processing_class=tokenizer)
    resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-2"))
    assert resumed.seed_log.records == logged
    assert_bitwise(snapshot(resumed.model), snapshot(full.model))
    other = ESTrainer(build_llama(tokenizer), recorded, args=es_args(tmp_path / "full", **{
        **common, "sigma_calibration_prompts": 8}), train_dataset=dataset, processing_class=tokenizer)
    with pytest.raises(ValueError, match=r"sigma_calibration_prompts \(checkpoint: 12, this run: 8\)"):
        other.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-2"))
    # a header written before the setting was logged: its run calibrated on one batch, once
    path = os.path.join(args.output_dir, "checkpoint-2", SEED_LOG_NAME)
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    for name in ("sigma_calibration_prompts", "sigma_adapt_steps"):
        del lines[0]["run_settings"][name]
    with open(path, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    again = ESTrainer(build_llama(tokenizer), recorded, args=es_args(tmp_path / "full", **common),
                      train_dataset=dataset, processing_class=tokenizer)
    with pytest.raises(ValueError, match=r"sigma_adapt_steps \(checkpoint: 0, this run: 2\); "
                                         r"sigma_calibration_prompts \(checkpoint: 0, this run: 12\)"):
        again.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-2"))


def test_sigma_calibration_prompts_draws_at_most_the_dataset(tmp_path, tokenizer, caplog):
    """More prompts than train_dataset holds: all of its rows, with one warning; an iterable dataset: none."""
    with caplog.at_level("WARNING"):
        small = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path, sigma_calibration_prompts=24),
                          train_dataset=prompts(), processing_class=tokenizer)
    assert ("sigma_calibration_prompts=24 asks sigma='auto' to calibrate on 20 prompts of train_dataset besides the "
            "iteration's batch, but it has 16 rows: it calibrates on 16 drawn prompts.") in caplog.text
    assert len(small.stability.calibration_rows([{"prompt": "b"}] * 4, 0)) == 20  # the first batch and all 16 rows
    caplog.clear()
    with caplog.at_level("WARNING"):
        stream = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path, sigma_calibration_prompts=8),
                           train_dataset=prompts().to_iterable_dataset(), processing_class=tokenizer)
    assert "but it is iterable (no length): it calibrates on 0 drawn prompts" in caplog.text
    assert stream.stability.calibration_rows([{"prompt": "x"}], 0) == [{"prompt": "x"}]
    caplog.clear()
    with caplog.at_level("WARNING"):
        exact = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path, sigma_calibration_prompts=20),
                          train_dataset=prompts(), processing_class=tokenizer)  # the batch (4) and all 16 drawn
        batch_only = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path, sigma_calibration_prompts=3),
                               train_dataset=prompts(), processing_class=tokenizer)  # fewer than the batch
    with caplog.at_level("WARNING"):
        evaluate_only = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path, sigma_calibration_prompts=8),
                                  processing_class=tokenizer)  # no train_dataset: nothing to draw, nothing to warn
    assert "sigma_calibration_prompts" not in caplog.text and evaluate_only.stability.draws == 0
    assert len(exact.stability.calibration_rows([], 0)) == 16 and batch_only.stability.calibration_rows([], 0) == []


def test_calibration_draws_under_zero3_and_for_an_environment(tmp_path, caplog):
    """ZeRO-3: the draws are a multiple of the process count (equal shares, together the W=1 draws' first ones); an
    environment that owns the data: as many placeholder rows as asked, no warning."""
    from types import SimpleNamespace

    import numpy as np

    from trl_es.trainer.es.es_stability import ESStability

    def stand_in(rank, owns_data=False, rows=20, sharded=True):
        args = SimpleNamespace(sigma="auto", sigma_calibration_prompts=14, prompt_batch_size=3, seed=0)
        return SimpleNamespace(args=args, sharded=sharded, train_dataset=[{"prompt": str(i)} for i in range(rows)],
                               accelerator=SimpleNamespace(num_processes=3, process_index=rank),
                               agents=SimpleNamespace(owns_data=owns_data))

    with caplog.at_level("WARNING"):
        shares = [ESStability(stand_in(rank)) for rank in range(3)]
    assert [s.draws for s in shares] == [9, 9, 9]
    assert ("asks sigma='auto' to calibrate on 11 prompts of train_dataset besides the iteration's batch, but its 3 "
            "ZeRO-3 processes roll out equal shares: it calibrates on 9 drawn prompts.") in caplog.text
    drawn = [row["prompt"] for s in shares for row in s.calibration_rows([], 0)]
    assert drawn == [str(i) for i in np.random.default_rng([0, 0]).choice(20, size=9, replace=False)]
    caplog.clear()
    with caplog.at_level("WARNING"):
        environment = ESStability(stand_in(0, owns_data=True, rows=3, sharded=False))  # (agents refuse ZeRO-3)
    assert environment.draws == 11 and not caplog.text  # 11 asked from 3 placeholder rows
    assert environment.calibration_rows([{"prompt": "b"}], 0) == [{"prompt": "b"}] + [{"prompt": "0"}] * 11


@pytest.mark.parametrize("backend", ["sequential", "batched_lowrank"])
def test_guard_rolls_back_a_made_up_collapse_and_replays_bitwise(tmp_path, tokenizer, caplog, backend):
    model = build_llama(tokenizer)
    args = es_args(tmp_path, sigma=0.02, max_steps=7, collapse_guard=True, collapse_guard_patience=2,
                   population_backend=backend)
    trainer = ESTrainer(model, collapsing(at=4), args=args, train_dataset=prompts(),
                        processing_class=tokenizer)
    states = {}
    original = trainer.seed_log.append

    def keep(*a, **k):  # the weights after every record
        original(*a, **k)
        states[len(trainer.seed_log.records)] = snapshot(trainer.model)
    trainer.seed_log.append = keep
    with caplog.at_level("WARNING"):
        trainer.train()
    header, logged = records(args.output_dir)
    rollbacks = [r for r in logged if "rollback_to" in r]
    assert [r["step"] for r in rollbacks] == [5, 7]  # drops measured at iterations 4, 5 and 6, 7
    best = max(range(3), key=lambda t: logged[t]["fitness_mean"])  # iteration t + 1 measured state t
    assert rollbacks[0]["rollback_to"] == best and rollbacks[0]["undone"] == list(range(4, best, -1))
    assert rollbacks[1]["rollback_to"] == best and rollbacks[1]["undone"] == [6]
    assert logged[5]["learning_rate"] == pytest.approx(0.02 * 0.5)  # alpha halved after the first rollback
    history = [h["es/rollbacks"] for h in trainer.state.log_history if "es/rollbacks" in h]
    assert history == [0, 0, 0, 0, 1, 1, 2]
    assert sum("Collapse guard" in r.message for r in caplog.records) == 2
    states[0] = snapshot(build_llama(tokenizer))
    for step in (5, 7):  # back at the best state's weights, up to fp32 rounding
        for name, value in states[step].items():
            torch.testing.assert_close(value, states[best][name], rtol=0, atol=1e-6)
    assert any(not torch.equal(states[4][k], states[best][k]) for k in states[best])
    rebuilt = replay(build_llama(tokenizer), args.output_dir)
    assert_bitwise(snapshot(rebuilt), snapshot(trainer.model))
    rebuilt = replay(build_llama(tokenizer), args.output_dir, max_step=5)
    assert_bitwise(snapshot(rebuilt), states[5])


@pytest.mark.parametrize(("backend", "sigma"), [("sequential", 0.02), ("batched_lowrank", "auto")])
def test_guard_resume_across_a_rollback_is_bitwise(tmp_path, tokenizer, backend, sigma):
    reward = collapsing(at=3)
    common = dict(sigma=sigma, max_steps=6, collapse_guard=True, collapse_guard_patience=1,
                  population_backend=backend)
    full = ESTrainer(build_llama(tokenizer), reward, args=es_args(tmp_path / "full", **common),
                     train_dataset=prompts(), processing_class=tokenizer)
    full.train()
    rolled = [r["step"] for r in full.seed_log.records if "rollback_to" in r]
    assert rolled[0] == 3  # checkpoint-3 ends with the rollback: the resumed run continues after it
    if sigma == "auto":  # sigma re-adapts on the batch after each rollback, and only there
        logged = full.seed_log.records
        calibrated = [r["step"] for r in logged if "sigma_probes" in r]
        assert calibrated == [1] + [r["step"] + 1 for r in logged[:-1] if "rollback_to" in r]
        assert all(0 <= r["sigma_effect"] <= 1 for r in logged if "sigma_probes" in r)
    args = es_args(tmp_path / "resumed", save_strategy="steps", save_steps=3, **common)
    ESTrainer(build_llama(tokenizer), reward, args=args, train_dataset=prompts(), processing_class=tokenizer).train()
    resumed = ESTrainer(build_llama(tokenizer), reward, args=args, train_dataset=prompts(),
                        processing_class=tokenizer)
    resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-3"))
    assert resumed.seed_log.records == full.seed_log.records
    assert_bitwise(snapshot(resumed.model), snapshot(full.model))


def test_guard_does_not_fire_on_a_flat_run(tmp_path, tokenizer):
    args = es_args(tmp_path, sigma=0.02, max_steps=8, collapse_guard=True)
    trainer = ESTrainer(build_llama(tokenizer), prompt_number, args=args, train_dataset=prompts(64),
                        processing_class=tokenizer)
    trainer.train()
    _, logged = records(args.output_dir)
    assert not any("rollback_to" in r for r in logged)
    means = [r["fitness_mean"] for r in logged]
    assert len(set(means)) > 3 and max(means) - min(means) > 0.1  # the batches differ: the noise is real
    assert [h["es/rollbacks"] for h in trainer.state.log_history if "es/rollbacks" in h] == [0] * 8
    # a guard that never fires changes nothing: the weights and the seed log's steps are the unguarded run's
    plain = ESTrainer(build_llama(tokenizer), prompt_number, args=es_args(tmp_path / "plain", sigma=0.02, max_steps=8),
                      train_dataset=prompts(64), processing_class=tokenizer)
    plain.train()
    assert_bitwise(snapshot(trainer.model), snapshot(plain.model))
    guard_keys = {"fitness_mean", "fitness_se"}
    assert [{k: v for k, v in r.items() if k not in guard_keys} for r in logged] == plain.seed_log.records


# ---------------------------------------------------------------------------------------------- two processes
@pytest.mark.distributed
def test_auto_sigma_and_guard_on_two_processes_match_one(tmp_path, tiny_model_dir, warm_python):
    """torchrun, population parallelism: the probes' counts and the guard's fitness are all-reduced, so both
    processes pick one sigma and one rollback, and the weights and seed log end as in one process."""
    import sys

    from paths import TESTS
    sys.path.insert(0, os.path.join(TESTS, "distributed"))
    sys.path.insert(0, os.path.join(TESTS, "trainer"))
    from test_distributed import run_here, torchrun, weights

    ref_out, _ = run_here(tmp_path / "one", tiny_model_dir, steps=4, stability=True)
    torchrun(tmp_path / "two", tiny_model_dir, "--steps", "4", "--stability", warm=warm_python)
    one, two = records(ref_out), records(tmp_path / "two")
    assert one == two
    assert one[0]["sigma"] == "auto" and "sigma_probes" in one[1][0]
    assert one[0]["run_settings"]["sigma_calibration_prompts"] == 8  # the batch and 4 drawn prompts, as one process
    assert [r["step"] for r in one[1] if "rollback_to" in r] == [3]  # at 4 the weights are the best state's
    # sigma chosen again every 2 iterations (sigma_adapt_steps) and after the rollback
    assert [r["step"] for r in one[1] if "sigma_probes" in r] == [1, 3, 4]
    assert_bitwise(weights(tmp_path / "two" / "model"), weights(ref_out / "model"))
    rebuilt = replay(build_llama_from(tiny_model_dir), str(tmp_path / "two"))
    assert_bitwise(dict(rebuilt.state_dict()), weights(tmp_path / "two" / "model"))


@pytest.mark.distributed
def test_auto_sigma_and_guard_under_zero3_match_one_process(tmp_path, tiny_model_dir, warm_python):
    """DeepSpeed ZeRO-3 on 2 processes (bf16 model, fp32 master partitions, each process on its own prompts): the
    probe counts and the fitness are summed over processes, and the rollback steps each master partition. Run as
    torchrun's two processes, as the other ZeRO tests (the deepspeed launcher's own run:
    tests/trainer/test_distributed.py's ``zero3_run``)."""
    import sys

    from paths import TESTS
    sys.path.insert(0, os.path.join(TESTS, "distributed"))
    sys.path.insert(0, os.path.join(TESTS, "trainer"))
    from test_distributed import run_here, torchrun, weights

    # the batch alone: the shares of drawn prompts are tested in test_calibration_draws_under_zero3_and_for_an_environment
    ref_out, _ = run_here(tmp_path / "one", tiny_model_dir, steps=4, stability=True, dtype="bfloat16",
                          calibration_prompts=0)
    result = torchrun(tmp_path / "zero3", tiny_model_dir, "--mode", "zero3", "--dtype", "bfloat16", "--steps", "4",
                      "--stability", "--calibration_prompts", "0", warm=warm_python)
    assert result["sharded"]
    one, three = records(ref_out), records(tmp_path / "zero3")
    assert one == three and any("rollback_to" in r for r in one[1])
    assert one[0]["run_settings"]["sigma_calibration_prompts"] == 0
    assert [r["step"] for r in one[1] if "sigma_probes" in r] == [1, 3, 4]  # every 2 iterations, after the rollback
    assert_bitwise(weights(tmp_path / "zero3" / "model"), weights(ref_out / "model"))


def build_llama_from(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder)


def test_measure_sigma_effect_leaves_the_model_and_sigma_as_they_were(tmp_path, tokenizer):
    model = build_llama(tokenizer)
    base = snapshot(model)
    trainer = ESTrainer(model, mean_code, args=es_args(tmp_path, sigma=0.02), train_dataset=prompts(),
                        processing_class=tokenizer)
    measured = trainer.measure_sigma_effect([1e-5, 1.0])
    assert measured["effects"][0] == [1e-5, 0.0] and measured["effects"][1][1] == 1.0  # no change, all changed
    assert measured["prompts"] == 4 and measured["members"] == 4
    assert 0 < measured["auto"]["sigma"] < 1 and measured["auto"]["target"] == 0.48
    assert trainer.strategy.sigma == 0.02
    assert_bitwise(snapshot(trainer.model), base)
    # a reward differs only where the completion does (the reward is a function of the completion)
    grid = [0.005, 0.02, 0.08]
    by_measure = trainer.measure_sigma_effect(grid)["effects_by_measure"]
    assert [s for s, _ in by_measure["rewards"]] == grid
    assert all(r <= c for (_, r), (_, c) in zip(by_measure["rewards"], by_measure["completions"], strict=True))
    assert by_measure["rewards"][-1][1] > 0
    assert all(math.isnan(e) or 0 <= e <= 1 for _, e in by_measure["ended_completions"])  # NaN: no row ended
