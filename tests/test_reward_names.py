"""Distinct reward-function names (reward_func_names), and metrics kept per function in training and evaluation."""

from functools import partial

import pytest
import torch
from datasets import Dataset
from tiny import build_llama
from transformers import LlamaConfig, LlamaForSequenceClassification

from trl_es import ESConfig, ESTrainer
from trl_es.rewards import base_reward_func_name, reward_func_names
from trl_es.rollout import RewardScorer


def constant(completions, value=0.0, **kwargs):
    return [value] * len(completions)


def length_share(completions, scale=1.0, **kwargs):
    return [scale * len(c) for c in completions]


class Judge:
    """A callable reward object; ``score`` is also used as a bound method."""

    def __init__(self, value):
        self.value = value

    def __call__(self, completions, **kwargs):
        return [self.value] * len(completions)

    def score(self, completions, **kwargs):
        return [self.value] * len(completions)


class Strict(Judge):
    pass


def _same_name_functions():
    def make(value):
        def correctness(completions, **kwargs):
            return [value] * len(completions)

        return correctness

    return make(0.0), make(1.0)


def _reward_model(tokenizer, name_or_path=""):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForSequenceClassification(config)
    model.config._name_or_path = name_or_path
    return model


@pytest.mark.parametrize(
    "funcs, expected",
    [
        ([partial(constant, value=1.0), partial(length_share, scale=2.0)], ["constant", "length_share"]),
        ([partial(constant, value=1.0), partial(constant, value=2.0)], ["constant_1", "constant_2"]),
        ([partial(partial(constant, value=1.0)), constant], ["constant_1", "constant_2"]),  # nested partial
        ([lambda completions, **kw: [0.0] * len(completions)], ["<lambda>"]),
        ([lambda completions, **kw: [0.0] * len(completions), lambda completions, **kw: [1.0] * len(completions)],
         ["<lambda>_1", "<lambda>_2"]),
        ([Judge(0.0).score, Judge(1.0).score], ["score_1", "score_2"]),
        ([Judge(0.0), Strict(1.0)], ["Judge", "Strict"]),
        ([Judge(0.0), Judge(1.0), constant], ["Judge_1", "Judge_2", "constant"]),
        ([*_same_name_functions()], ["correctness_1", "correctness_2"]),
        # A suffixed name already taken by another function is skipped.
        ([constant, constant, partial(constant), Judge(1.0).score],
         ["constant_1", "constant_2", "constant_3", "score"]),
    ],
)
def test_reward_func_names(funcs, expected):
    names = reward_func_names(funcs)
    assert names == expected
    assert len(set(names)) == len(names)
    assert RewardScorer(funcs).names == expected  # what every trainer and trl-es eval log under


def test_suffix_never_collides_with_an_existing_name():
    def constant_1(completions, **kwargs):
        return [0.0] * len(completions)

    assert reward_func_names([constant, constant, constant_1]) == ["constant_2", "constant_3", "constant_1"]


def test_reward_model_names(tokenizer):
    unnamed, named, other = (_reward_model(tokenizer), _reward_model(tokenizer, "org/my-rm"),
                             _reward_model(tokenizer, "/models/my-rm"))
    assert base_reward_func_name(unnamed) == "LlamaForSequenceClassification"
    assert reward_func_names([named, constant]) == ["my-rm", "constant"]
    assert reward_func_names([named, other, unnamed]) == ["my-rm_1", "my-rm_2", "LlamaForSequenceClassification"]
    with pytest.raises(TypeError, match=r"reward_funcs\[1\] must be a callable or a reward model, got int"):
        reward_func_names([constant, 3])


def test_es_trainer_keeps_metrics_per_function(tmp_path, tokenizer):
    """Two partials of one function used to share the key rewards/partial/mean (the mean of both) in training and
    the last one only in evaluate(); now each has its own key, with its own value."""
    rewards = [partial(constant, value=0.25), partial(constant, value=0.75), partial(length_share, scale=0.0)]
    args = ESConfig(output_dir=str(tmp_path), max_steps=1, population_size=2, prompt_batch_size=2,
                    max_completion_length=3, noise_table_size=1 << 20, report_to=[], save_strategy="no",
                    disable_tqdm=True, sigma=0.02, learning_rate=0.02)
    data = Dataset.from_dict({"prompt": [f"Write: {i}" for i in range(4)]})
    trainer = ESTrainer(build_llama(tokenizer), rewards, args=args, train_dataset=data, eval_dataset=data,
                        processing_class=tokenizer)
    assert trainer.reward_func_names == ["constant_1", "constant_2", "length_share"]
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "reward" in h)
    assert logged["rewards/constant_1/mean"] == 0.25 and logged["rewards/constant_2/mean"] == 0.75
    assert logged["rewards/length_share/mean"] == 0.0
    assert not any("partial" in key for key in logged)
    metrics = trainer.evaluate()
    assert metrics["eval_rewards/constant_1/mean"] == 0.25 and metrics["eval_rewards/constant_2/mean"] == 0.75
    assert metrics["eval_rewards/length_share/mean"] == 0.0
    assert metrics["eval_reward"] == 1.0  # weights 1: 0.25 + 0.75 + 0
