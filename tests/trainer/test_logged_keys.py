"""What a training log prints: GRPOTrainer's keys plus ES's own (docs/es_trainer.md, "Logged metrics"); the drift of
each module type only with ``log_module_drift=True``."""

import ast

import pytest
from datasets import Dataset
from tiny import build_llama

from trl_es import ESConfig, ESTrainer


GRPO_KEYS = {
    "loss", "learning_rate", "epoch", "num_tokens", "reward", "reward_std", "frac_reward_zero_std",
    "completions/mean_length", "completions/min_length", "completions/max_length", "completions/clipped_ratio",
    "completions/mean_terminated_length", "completions/min_terminated_length", "completions/max_terminated_length",
}
"""GRPOTrainer's keys ES has a quantity for (and Trainer's loss, learning_rate, epoch), besides rewards/<name>/*."""
ES_KEYS = {
    "fitness/mean", "fitness/std", "reward_min", "reward_max", "num_nan_members", "num_invalid_rewards",
    "success_rate", "success_diversity", "completions_per_second", "completion_tokens", "time/generation_and_reward",
    "time/perturb", "time/restore", "time/update", "time/other", "comm/bytes", "drift/l2", "drift/relative",
}
MODULE_TYPES = ("down_proj", "embed_tokens", "gate_proj", "input_layernorm", "k_proj", "lm_head", "norm", "o_proj",
                "post_attention_layernorm", "q_proj", "up_proj", "v_proj")
"""The module types of the tiny Llama (trl_es.analysis.drift.group_name)."""


def reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


def reward_a(completions, **kwargs):
    return [float(c.count("a")) for c in completions]


def printed_step_logs(tmp_path, tokenizer, capsys, reward_funcs, **kwargs):
    """The dicts the step logs printed (PrinterCallback, one line each) of a 2-step run."""
    args = ESConfig(output_dir=str(tmp_path / "out"), max_steps=2, population_size=2, prompt_batch_size=2,
                    max_completion_length=3, report_to=[], save_strategy="no", noise_table_size=1 << 20,
                    disable_tqdm=True, **kwargs)
    trainer = ESTrainer(build_llama(tokenizer), reward_funcs, args=args, processing_class=tokenizer,
                        train_dataset=Dataset.from_list([{"prompt": f"Say {i}"} for i in range(4)]))
    capsys.readouterr()
    trainer.train()
    logs = [ast.literal_eval(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    steps = [log for log in logs if "loss" in log]
    assert len(steps) == 2 and [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2]
    for log, history in zip(steps, [h for h in trainer.state.log_history if "loss" in h], strict=True):
        assert set(history) - {"step"} == set(log)  # log_history holds what is printed
    return steps


def test_default_log_is_grpos_keys_and_es_own(tmp_path, tokenizer, capsys):
    for log in printed_step_logs(tmp_path, tokenizer, capsys, reward_len):
        assert set(log) == GRPO_KEYS | ES_KEYS | {"rewards/reward_len/mean", "rewards/reward_len/std"}
        assert len(log) == 34


def test_two_reward_functions_add_two_keys_each(tmp_path, tokenizer, capsys):
    for log in printed_step_logs(tmp_path, tokenizer, capsys, [reward_len, reward_a]):
        rewards = {f"rewards/{name}/{stat}" for name in ("reward_len", "reward_a") for stat in ("mean", "std")}
        assert set(log) == GRPO_KEYS | ES_KEYS | rewards
        assert len(log) == 36


def test_log_module_drift_adds_two_keys_per_module_type(tmp_path, tokenizer, capsys):
    for log in printed_step_logs(tmp_path, tokenizer, capsys, reward_len, log_module_drift=True):
        modules = {f"drift/{kind}/{group}" for kind in ("l2", "relative") for group in MODULE_TYPES}
        assert set(log) == GRPO_KEYS | ES_KEYS | {"rewards/reward_len/mean", "rewards/reward_len/std"} | modules
        assert len(log) == 34 + 24


def test_no_drift_logged_drops_the_two_drift_keys(tmp_path, tokenizer, capsys):
    for log in printed_step_logs(tmp_path, tokenizer, capsys, reward_len, log_parameter_drift=False):
        assert set(log) == (GRPO_KEYS | ES_KEYS | {"rewards/reward_len/mean", "rewards/reward_len/std"}) - {
            "drift/l2", "drift/relative"}
        assert len(log) == 32


def test_log_module_drift_without_drift_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"log_module_drift=True .* log_parameter_drift=False"):
        ESConfig(output_dir=str(tmp_path), log_module_drift=True, log_parameter_drift=False)
