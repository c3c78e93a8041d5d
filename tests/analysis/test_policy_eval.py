"""trl_es.analysis.entropy and trl_es.analysis.policy_eval: the per-arm measurements of the recipes."""

import copy
import math

import pytest
import torch

from trl_es.analysis import TokenEntropyRecorder, evaluate_policy, greedy_accuracy, mean_completion_entropy
from trl_es.generation import generate_completions
from trl_es.tasks.arithmetic import make_arithmetic_dataset_dict
from trl_es.rollout import build_generation_config, prompt_texts

pytestmark = pytest.mark.usefixtures("one_thread")


def test_recorder_entropy_by_hand():
    recorder = TokenEntropyRecorder()
    scores = torch.tensor([[0.0, 0.0, -math.inf], [0.0, math.log(3.0), -math.inf]])
    assert recorder(None, scores) is scores  # sampling is not affected
    recorder(None, torch.tensor([[0.0, -math.inf, -math.inf], [0.0, 0.0, 0.0]]))
    h_half = math.log(2.0)
    h_quarter = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert recorder.steps[0].tolist() == pytest.approx([h_half, h_quarter], abs=1e-6)
    assert recorder.steps[1].tolist() == pytest.approx([0.0, math.log(3.0)], abs=1e-6)
    assert recorder.steps[1][0].item() == 0.0  # a one-hot distribution: exactly 0, no NaN from 0 * log 0
    # row 0 generated two tokens, row 1 one (its step 1 is padding after EOS and does not count)
    out = mean_completion_entropy(recorder, [[5, 6], [7]])
    assert out["num_tokens"] == 3
    assert out["mean"] == pytest.approx((h_half + 0.0 + h_quarter) / 3, abs=1e-6)
    hot = TokenEntropyRecorder(temperature=0.5)
    hot(None, torch.tensor([[0.0, math.log(3.0)]]))  # p = softmax([0, 2 ln 3]) = (1/10, 9/10)
    assert hot.steps[0].item() == pytest.approx(-(0.1 * math.log(0.1) + 0.9 * math.log(0.9)), abs=1e-6)
    with pytest.raises(ValueError, match="rows"):
        mean_completion_entropy(recorder, [[1]])
    with pytest.raises(ValueError, match="temperature"):
        TokenEntropyRecorder(0.0)


def test_recorder_matches_a_forward_pass(tiny_llama, tokenizer):
    rows = [make_arithmetic_dataset_dict(3, 0, 0, seed=1)["train"][i] for i in range(3)]
    prompts = prompt_texts(rows, tokenizer)
    recorder = TokenEntropyRecorder()
    torch.manual_seed(0)
    config = build_generation_config(tokenizer, 6, temperature=1.0)
    out = generate_completions(tiny_llama, tokenizer, prompts, config, 2, logits_processor=[recorder])
    got = mean_completion_entropy(recorder, out.ids)
    total, count = 0.0, 0
    with torch.no_grad():
        for row, ids in enumerate(out.ids):
            prompt = tokenizer(prompts[row // 2], add_special_tokens=False)["input_ids"]
            logits = tiny_llama(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(ids)]
            logp = torch.log_softmax(logits.double(), dim=-1)
            total += float(-(logp.exp() * logp).sum())
            count += len(ids)
    assert got["num_tokens"] == count == sum(len(ids) for ids in out.ids)
    assert got["mean"] == pytest.approx(total / count, abs=1e-4)


def good_reward(completions, good, **kwargs):
    """1.0 for the prompts marked good, whatever the completion."""
    return [float(g) for g in good]


def test_evaluate_policy_by_hand(tiny_llama, tokenizer):
    dataset = make_arithmetic_dataset_dict(4, 0, 0, seed=2)["train"]
    rows = [dict(dataset[i], good=i % 2 == 0) for i in range(4)]  # prompts 0 and 2 always succeed, 1 and 3 never
    base = copy.deepcopy(tiny_llama)
    report = evaluate_policy(tiny_llama, tokenizer, rows, [good_reward], 4, num_samples=4, pass_k=(1, 2, 4),
                             base_model=base, off_task_prompts=["Say hi.", [{"role": "user", "content": "Hello"}]],
                             kl_max_new_tokens=3, batch_size=3, sample_batch_size=2)
    assert report["num_prompts"] == 4 and report["num_samples"] == 4
    assert report["accuracy_greedy"] == 0.5
    assert report["correct_per_prompt"] == [4, 0, 4, 0]
    assert report["pass@1"] == report["pass@2"] == report["pass@4"] == 0.5
    assert report["js_succ"] == pytest.approx(math.log(2.0), abs=1e-12)  # h(1/2) - mean(h(1), h(0), ...) = ln 2
    assert 0 < report["token_entropy"] <= math.log(len(tokenizer)) + 1e-6
    assert report["drift_l2"] == 0.0 and report["off_task_kl"] == 0.0  # the base model itself: exactly 0
    assert greedy_accuracy(tiny_llama, tokenizer, rows, [good_reward], 4) == 0.5
    only_greedy = evaluate_policy(tiny_llama, tokenizer, rows, [good_reward], 4, num_samples=0)
    assert set(only_greedy) == {"num_prompts", "accuracy_greedy"}
    with pytest.raises(ValueError, match="pass_k"):
        evaluate_policy(tiny_llama, tokenizer, rows, [good_reward], 4, num_samples=2, pass_k=(4,))


def test_sample_policy_scores_records_and_is_seeded(tiny_llama, tokenizer):
    from trl_es.analysis import sample_policy

    dataset = make_arithmetic_dataset_dict(5, 0, 0, seed=3)["train"]
    rows = [dict(dataset[i], good=i in (1, 4)) for i in range(5)]
    config = build_generation_config(tokenizer, 5, temperature=0.8, top_p=0.95)
    torch.manual_seed(7)
    before = torch.random.get_rng_state()
    out = sample_policy(tiny_llama, tokenizer, rows, [good_reward], config, 3, sample_batch_size=2, seed=11,
                        progress=False)
    assert torch.equal(torch.random.get_rng_state(), before)  # sampled inside fork_rng: the caller's RNG is kept
    assert out["rewards_per_func"].shape == (5, 3, 1) and out["rewards_per_func"].dtype == torch.float32
    assert out["correct"] == [0, 3, 0, 0, 3]
    assert out["token_entropy_tokens"] > 0
    assert out["token_entropy"] == pytest.approx(out["token_entropy_sum"] / out["token_entropy_tokens"])
    again = sample_policy(tiny_llama, tokenizer, rows, [good_reward], config, 3, sample_batch_size=2, seed=11,
                          progress=False)
    assert again["token_entropy_sum"] == out["token_entropy_sum"]  # same seed: the same samples
    other = sample_policy(tiny_llama, tokenizer, rows, [good_reward], config, 3, sample_batch_size=2, seed=12,
                          progress=False)
    assert other["token_entropy_sum"] != out["token_entropy_sum"]
    # evaluate_policy's sampled figures are this pass's
    report = evaluate_policy(tiny_llama, tokenizer, rows, [good_reward], 5, num_samples=3, pass_k=(1, 3),
                             temperature=0.8, top_p=0.95, sample_batch_size=2, seed=11, progress=False)
    assert report["correct_per_prompt"] == out["correct"]
    assert report["token_entropy"] == out["token_entropy"]
    assert report["token_entropy_tokens"] == out["token_entropy_tokens"]
    plain = sample_policy(tiny_llama, tokenizer, rows, [good_reward], config, 3, 2, seed=11, record_entropy=False,
                          progress=False)
    assert plain["correct"] == out["correct"] and math.isnan(plain["token_entropy"])
    assert plain["token_entropy_tokens"] == 0
    empty = sample_policy(tiny_llama, tokenizer, [], [good_reward], config, 3, progress=False)
    assert empty["rewards_per_func"].shape == (0, 3, 1) and empty["correct"] == []
    with pytest.raises(ValueError, match="generation_config must sample"):
        sample_policy(tiny_llama, tokenizer, rows, [good_reward], build_generation_config(tokenizer, 5), 3)
    with pytest.raises(ValueError, match="num_samples must be an integer >= 1"):
        sample_policy(tiny_llama, tokenizer, rows, [good_reward], config, 0)
    with pytest.raises(ValueError, match="sample_batch_size must be an integer >= 1"):
        sample_policy(tiny_llama, tokenizer, rows, [good_reward], config, 2, sample_batch_size=0)


def test_sample_batch_size_none_fills_calls_to_the_row_target(tiny_llama, tokenizer, monkeypatch):
    from trl_es.analysis import SAMPLE_ROWS_PER_CALL, auto_sample_batch_size, policy_eval, sample_policy

    assert SAMPLE_ROWS_PER_CALL == 128
    # about 128 rows a call; one prompt a call from 64 samples on (its rows share the whole prompt)
    assert [auto_sample_batch_size(n) for n in (1, 16, 32, 63, 64, 100, 200)] == [128, 8, 4, 2, 1, 1, 1]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_samples must be an integer >= 1"):
            auto_sample_batch_size(bad)
    dataset = make_arithmetic_dataset_dict(5, 0, 0, seed=3)["train"]
    rows = [dict(dataset[i], good=i in (1, 4)) for i in range(5)]
    config = build_generation_config(tokenizer, 5, temperature=0.8, top_p=0.95)
    monkeypatch.setattr(policy_eval, "SAMPLE_ROWS_PER_CALL", 8)  # 3 samples: 8 // 3 = 2 prompts a call
    auto = sample_policy(tiny_llama, tokenizer, rows, [good_reward], config, 3, seed=11, progress=False)
    two = sample_policy(tiny_llama, tokenizer, rows, [good_reward], config, 3, 2, seed=11, progress=False)
    one = sample_policy(tiny_llama, tokenizer, rows, [good_reward], config, 3, 1, seed=11, progress=False)
    assert auto["token_entropy_sum"] == two["token_entropy_sum"]  # the same calls: the same samples
    assert auto["token_entropy_sum"] != one["token_entropy_sum"]
