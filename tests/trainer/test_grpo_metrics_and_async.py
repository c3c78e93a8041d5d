"""GRPOTrainer parity (issue 33, parts 3 and 4): async reward functions, ``reward_processing_classes``, TRL's metric
names and values, ``eval_loss`` and ``load_best_model_at_end`` with Trainer's default metric."""

import asyncio
import functools
import math
import os
import statistics

import pytest
import torch
from datasets import Dataset
from test_resume_trust import ScriptedEval
from tiny import build_llama, build_reward_model

from trl_es import ESConfig, ESTrainer
from trl_es.rollout import RewardScorer, is_async_reward_func

SMALL_TABLE = 1 << 20


def es_args(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path / "out"), max_steps=1, population_size=4, prompt_batch_size=4,
                    max_completion_length=6, sigma=0.02, learning_rate=0.02, report_to=[], save_strategy="no",
                    noise_table_size=SMALL_TABLE, disable_tqdm=True, seed=0)
    defaults.update(kwargs)
    return ESConfig(**defaults)


def prompts(n=8, offset=0, word="Write"):
    return Dataset.from_dict({"prompt": [f"{word}: {i}" for i in range(offset, offset + n)]})


def text(c):
    return c if isinstance(c, str) else c[0]["content"]


# ---------------------------------------------------------------------------------------------- sync / async twins
def length_reward(completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


async def async_length_reward(completions, completion_ids, **kwargs):
    await asyncio.sleep(0)
    return [float(len(ids)) for ids in completion_ids]


def mean_code(completions, **kwargs):
    return [sum(map(ord, text(c))) / (128 * max(1, len(text(c)))) for c in completions]


async def async_mean_code(completions, **kwargs):
    await asyncio.sleep(0)
    return mean_code(completions)


class AsyncCallable:
    """An instance whose ``__call__`` is async (detected as GRPOTrainer's ``is_async_callable`` does)."""

    __name__ = "async_callable"

    async def __call__(self, completions, **kwargs):
        return mean_code(completions)


def snapshot(model):
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def score(funcs, n=6):
    rows = [{"prompt": f"Write: {i}"} for i in range(n)]
    completions = [f"ab{'c' * i}" for i in range(n)]
    ids = [list(range(i + 1)) for i in range(n)]
    return RewardScorer(funcs).score(rows, completions, ids)


def test_async_detection():
    assert is_async_reward_func(async_length_reward)
    assert is_async_reward_func(functools.partial(async_length_reward))
    assert is_async_reward_func(AsyncCallable())
    assert not is_async_reward_func(length_reward)


def test_async_scores_equal_sync_twins_exactly():
    sync_rewards, sync_invalid = score([length_reward, mean_code, mean_code])
    async_rewards, async_invalid = score([async_length_reward, async_mean_code, AsyncCallable()])
    assert torch.equal(sync_rewards, async_rewards) and torch.equal(sync_invalid, async_invalid)
    mixed, _ = score([async_length_reward, mean_code, functools.partial(async_mean_code)])  # columns keep their order
    assert torch.equal(mixed, sync_rewards)


def test_async_training_equals_sync_training(tmp_path, tokenizer):
    """The same run with async twins of the reward functions (one sync function kept: a mix): the same logged
    rewards and the same trained weights, bit for bit."""
    runs = {}
    for kind, funcs in (("sync", [length_reward, mean_code]), ("async", [async_length_reward, mean_code])):
        trainer = ESTrainer(build_llama(tokenizer), funcs, args=es_args(tmp_path / kind, max_steps=2),
                            train_dataset=prompts(), processing_class=tokenizer)
        trainer.train()
        runs[kind] = trainer
    sync_logs = [h for h in runs["sync"].state.log_history if "reward" in h]
    async_logs = [h for h in runs["async"].state.log_history if "reward" in h]
    assert len(sync_logs) == len(async_logs) == 2
    for key in ("reward", "reward_std", "fitness/mean", "rewards/mean_code/mean", "rewards/mean_code/std"):
        assert [h[key] for h in sync_logs] == [h[key] for h in async_logs], key
    for stat in ("mean", "std"):  # the same function under its own name
        assert [h[f"rewards/length_reward/{stat}"] for h in sync_logs] == \
            [h[f"rewards/async_length_reward/{stat}"] for h in async_logs]
    assert [r["coefficients"] for r in runs["sync"].seed_log.records] == \
        [r["coefficients"] for r in runs["async"].seed_log.records]
    a, b = snapshot(runs["sync"].model), snapshot(runs["async"].model)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_two_async_functions_run_concurrently():
    """Each function sets its own event, then waits for the other's: run one after the other, the first would wait
    forever (here: time out); gathered, both finish."""
    first, second = asyncio.Event(), asyncio.Event()

    async def ping(completions, **kwargs):
        first.set()
        await asyncio.wait_for(second.wait(), timeout=20)
        return [1.0] * len(completions)

    async def pong(completions, **kwargs):
        second.set()
        await asyncio.wait_for(first.wait(), timeout=20)
        return [2.0] * len(completions)

    rewards, _ = score([ping, length_reward, pong], n=3)
    assert rewards[:, 0].tolist() == [1.0] * 3 and rewards[:, 2].tolist() == [2.0] * 3
    assert rewards[:, 1].tolist() == [1.0, 2.0, 3.0]


def test_async_functions_overlap_in_training(tmp_path, tokenizer):
    """In every member rollout of a training run, two async functions are in flight together."""
    state = {"in_flight": 0, "max": 0, "calls": 0}

    def make(name):
        async def func(completions, **kwargs):
            state["in_flight"] += 1
            state["calls"] += 1
            state["max"] = max(state["max"], state["in_flight"])
            for _ in range(3):
                await asyncio.sleep(0)
            state["in_flight"] -= 1
            return [0.5] * len(completions)
        func.__name__ = name
        return func

    trainer = ESTrainer(build_llama(tokenizer), [make("a"), make("b")], args=es_args(tmp_path),
                        train_dataset=prompts(), processing_class=tokenizer)
    trainer.train()
    assert state["calls"] >= 2 and state["max"] == 2
    assert trainer.state.log_history[0]["reward"] == pytest.approx(1.0)


def test_async_output_is_validated_as_sync():
    def wrong_count(completions, **kwargs):
        return [1.0] * (len(completions) - 1)

    async def async_wrong_count(completions, **kwargs):
        return [1.0] * (len(completions) - 1)

    def not_a_number(completions, **kwargs):
        return ["x"] * len(completions)

    async def async_not_a_number(completions, **kwargs):
        return ["x"] * len(completions)

    def nan_reward(completions, **kwargs):
        return [math.nan, None] + [1.0] * (len(completions) - 2)

    async def async_nan_reward(completions, **kwargs):
        return [math.nan, None] + [1.0] * (len(completions) - 2)

    for sync, asynchronous, error in ((wrong_count, async_wrong_count, ValueError),
                                      (not_a_number, async_not_a_number, TypeError)):
        asynchronous.__name__ = sync.__name__  # the messages name the function
        with pytest.raises(error) as sync_error:
            score([sync])
        with pytest.raises(error) as async_error:
            score([asynchronous, mean_code])
        assert str(sync_error.value) == str(async_error.value)
        assert "wrong_count" in str(sync_error.value) or "not_a_number" in str(sync_error.value)
    sync_rewards, sync_invalid = score([nan_reward])
    async_rewards, async_invalid = score([async_nan_reward])
    assert torch.equal(sync_invalid, async_invalid) and sync_invalid[:, 0].tolist()[:2] == [True, False]
    assert torch.equal(torch.isnan(sync_rewards), torch.isnan(async_rewards))


def test_async_exception_propagates_and_cancels_the_others():
    cancelled = []

    async def slow(completions, **kwargs):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return [0.0] * len(completions)

    async def broken(completions, **kwargs):
        raise RuntimeError("judge unreachable")

    with pytest.raises(RuntimeError, match="judge unreachable"):
        score([slow, broken])
    assert cancelled == [True]


# ---------------------------------------------------------------------------------------------- reward_processing_classes
def test_reward_processing_classes_as_grpo(tmp_path, tokenizer):
    from trl import GRPOConfig, GRPOTrainer

    reward_model = build_reward_model(tokenizer)
    funcs = [length_reward, reward_model, async_mean_code]
    given = [None, tokenizer, None]
    trainer = ESTrainer(build_llama(tokenizer), funcs, args=es_args(tmp_path), train_dataset=prompts(),
                        processing_class=tokenizer, reward_processing_classes=list(given))
    grpo = GRPOTrainer(build_llama(tokenizer), funcs, args=GRPOConfig(
        output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=2, num_generations=2, report_to=[],
        max_completion_length=4, use_cpu=True), train_dataset=prompts(), processing_class=tokenizer,
        reward_processing_classes=list(given))
    assert len(trainer.reward_processing_classes) == len(grpo.reward_processing_classes) == 3
    for ours, theirs in zip(trainer.reward_processing_classes, grpo.reward_processing_classes, strict=True):
        assert ours is theirs
    assert trainer.reward_processing_classes is trainer.reward_scorer.processing_classes
    plain = ESTrainer(build_llama(tokenizer), [length_reward, async_mean_code], args=es_args(tmp_path / "plain"),
                      train_dataset=prompts(), processing_class=tokenizer)
    assert plain.reward_processing_classes == [None, None]


# ---------------------------------------------------------------------------------------------- metrics
def unbiased_std(values):
    return statistics.stdev(values) if len(values) > 1 else None


def test_grpo_metric_keys_and_values(tmp_path, tokenizer):
    """reward = completion length (and a second function, 2 x length): every GRPO key's value from the completion
    ids the reward saw, over all 4 members x 4 prompts."""
    seen = []

    def length(completions, completion_ids, **kwargs):
        seen.extend(list(ids) for ids in completion_ids)
        return [float(len(ids)) for ids in completion_ids]

    async def double_length(completions, completion_ids, **kwargs):
        return [2.0 * len(ids) for ids in completion_ids]

    data = prompts(4)
    trainer = ESTrainer(build_llama(tokenizer), [length, double_length], args=es_args(tmp_path, max_completion_length=4),
                        train_dataset=data, processing_class=tokenizer)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert len(seen) == 16  # population 4 x 4 prompts x 1 generation
    lengths = [len(ids) for ids in seen]
    ends = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    done = [len(ids) for ids in seen if ids and ids[-1] in ends]
    weighted = [3.0 * n for n in lengths]  # weights 1, 1
    assert logs["reward"] == pytest.approx(statistics.mean(weighted))
    assert logs["reward_std"] == pytest.approx(unbiased_std(weighted))
    assert logs["rewards/length/mean"] == pytest.approx(statistics.mean(lengths))
    assert logs["rewards/length/std"] == pytest.approx(unbiased_std(lengths))
    assert logs["rewards/double_length/mean"] == pytest.approx(2 * statistics.mean(lengths))
    assert logs["rewards/double_length/std"] == pytest.approx(2 * unbiased_std(lengths))
    assert logs["completions/mean_length"] == pytest.approx(statistics.mean(lengths))
    assert logs["completions/min_length"] == min(lengths)
    assert logs["completions/max_length"] == max(lengths)
    assert logs["completions/clipped_ratio"] == pytest.approx(1 - len(done) / len(lengths))
    assert logs["completions/mean_terminated_length"] == pytest.approx(statistics.mean(done) if done else 0.0)
    assert logs["completions/min_terminated_length"] == (min(done) if done else 0.0)
    assert logs["completions/max_terminated_length"] == (max(done) if done else 0.0)
    assert logs["frac_reward_zero_std"] == 1.0  # num_generations=1: one sample per group, as GRPOTrainer
    prompt_tokens = sum(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in data["prompt"])
    assert logs["num_tokens"] == 4 * prompt_tokens + sum(lengths)
    assert trainer.state.num_input_tokens_seen == logs["num_tokens"]
    assert logs["completion_tokens"] == sum(lengths)
    # ES's own keys stay
    for key in ("fitness/mean", "fitness/std", "reward_min", "reward_max", "num_nan_members", "num_invalid_rewards",
                "completions_per_second", "time/generation_and_reward", "time/update"):
        assert key in logs, key
    assert logs["fitness/mean"] == pytest.approx(logs["reward"])  # equal counts: the pooled mean is the members'
    assert logs["loss"] == pytest.approx(-logs["fitness/mean"])


def test_num_tokens_is_a_running_total(tmp_path, tokenizer):
    trainer = ESTrainer(build_llama(tokenizer), length_reward, args=es_args(tmp_path, max_steps=2),
                        train_dataset=prompts(), processing_class=tokenizer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "num_tokens" in h]
    assert len(logs) == 2 and 0 < logs[0]["num_tokens"] < logs[1]["num_tokens"]
    assert logs[1]["num_tokens"] == trainer.state.num_input_tokens_seen


def test_frac_reward_zero_std(tmp_path, tokenizer):
    """num_generations=2: a group (one member's two samples of a prompt) has zero spread on even prompts (constant
    reward) and spread on odd ones (0, 1 by position in the group): half of the groups."""
    def by_prompt(prompts, completions, **kwargs):
        return [1.0 if int(str(p).split(": ")[1]) % 2 == 0 else float(j % 2) for j, p in enumerate(prompts)]

    trainer = ESTrainer(build_llama(tokenizer), by_prompt, args=es_args(tmp_path, num_generations=2, temperature=1.0),
                        train_dataset=prompts(4), processing_class=tokenizer)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["frac_reward_zero_std"] == pytest.approx(0.5)
    values = [1.0, 1.0, 0.0, 1.0] * 8  # 4 members x (2 even prompts: 1, 1; 2 odd ones: 0, 1), per prompt pair
    assert logs["reward"] == pytest.approx(statistics.mean(values))
    assert logs["reward_std"] == pytest.approx(statistics.stdev(values))


# ---------------------------------------------------------------------------------------------- eval_loss, load best
def test_eval_loss_is_minus_eval_reward(tmp_path, tokenizer):
    trainer = ESTrainer(build_llama(tokenizer), [mean_code, async_length_reward], args=es_args(tmp_path),
                        train_dataset=prompts(), eval_dataset=prompts(4, offset=20), processing_class=tokenizer)
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == -metrics["eval_reward"]
    assert metrics["eval_reward"] > 0


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def cancelling_reward(completions, **kwargs):
    return [(-1.0) ** j for j in range(len(completions))]  # +1, -1, ...: a mean of exactly 0.0


@pytest.mark.parametrize("reward", [zero_reward, cancelling_reward])
def test_a_zero_mean_reward_logs_a_loss_of_plus_zero(tmp_path, tokenizer, reward):
    """-mean(reward) of a zero mean is logged as 0.0, never -0.0 (eval_loss, the training loss and train_loss)."""
    trainer = ESTrainer(build_llama(tokenizer), reward, args=es_args(tmp_path, num_generations=2, logging_steps=1),
                        train_dataset=prompts(), eval_dataset=prompts(4, offset=20), processing_class=tokenizer)
    metrics = trainer.evaluate()
    assert metrics["eval_reward"] == 0.0 and math.copysign(1.0, metrics["eval_loss"]) == 1.0
    output = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses == [0.0] and math.copysign(1.0, losses[0]) == 1.0
    assert output.training_loss == 0.0 and math.copysign(1.0, output.training_loss) == 1.0


def test_load_best_model_at_end_with_the_default_metric(tmp_path, tokenizer):
    """No metric_for_best_model: Trainer's default "loss" reads eval_loss; the best (lowest eval_loss = highest eval
    reward, at step 2 of 3) checkpoint is kept."""
    args = es_args(tmp_path, max_steps=3, save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
                   load_best_model_at_end=True)
    assert args.metric_for_best_model == "loss" and args.greater_is_better is False
    trainer = ESTrainer(build_llama(tokenizer), ScriptedEval({1: 0.1, 2: 0.9, 3: 0.3}), args=args,
                        train_dataset=prompts(), eval_dataset=Dataset.from_dict({"prompt": ["Eval: 0", "Eval: 1"]}),
                        processing_class=tokenizer)
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert [h["eval_loss"] for h in evals] == pytest.approx([-0.1, -0.9, -0.3])
    best = min(evals, key=lambda h: h["eval_loss"])
    assert trainer.state.best_metric == pytest.approx(best["eval_loss"])
    assert trainer.state.best_model_checkpoint == os.path.join(args.output_dir, f"checkpoint-{best['step']}")
    assert best["step"] == 2
