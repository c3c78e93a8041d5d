"""ESTrainer / ESConfig on tiny models: the TRL integration, exactness guarantees, bad input."""

import json
import math
import os
import re

import pytest
import torch
from datasets import Dataset
from tiny import build_llama, build_qwen2
from transformers import AutoModelForCausalLM

from trl_es import ESConfig, ESTrainer, replay
from trl_es.es import SEED_LOG_NAME

SMALL_TABLE = 1 << 20


def es_args(tmp_path, **kwargs):
    defaults = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        population_size=4,
        prompt_batch_size=4,
        max_completion_length=6,
        sigma=0.02,
        learning_rate=0.02,
        report_to=[],
        save_strategy="no",
        noise_table_size=SMALL_TABLE,
        disable_tqdm=True,
        seed=0,
    )
    defaults.update(kwargs)
    return ESConfig(**defaults)


def prompts(n=8, conversational=False, offset=0):
    if conversational:
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Write: {i}"}] for i in range(offset, offset + n)]})
    return Dataset.from_dict({"prompt": [f"Write: {i}" for i in range(offset, offset + n)]})


def text(c):
    return c if isinstance(c, str) else c[0]["content"]


def share_a(completions, **kwargs):
    """Share of the character 'a' in each completion."""
    return [text(c).count("a") / max(1, len(text(c))) for c in completions]


def mean_code(completions, **kwargs):
    """Mean character code / 128: a reward that differs between almost any two completions."""
    return [sum(map(ord, text(c))) / (128 * max(1, len(text(c)))) for c in completions]


def snapshot(model):
    """A CPU copy of the state dict (the Trainer may have moved the model to an accelerator)."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_changed(a, b):
    assert any(not torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------- config
def test_default_config_constructs_on_cpu(tmp_path):
    args = ESConfig(output_dir=str(tmp_path))
    assert (args.population_size, args.sigma, args.learning_rate) == (30, 1e-3, 5e-4)
    assert args.fitness_shaping == "zscore" and args.temperature == 0.0 and args.es_optimizer == "es"
    assert args.bf16 is False and args.weight_decay == 0.0 and args.max_grad_norm == 0.0
    assert args.lr_scheduler_type == "constant"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"population_size": 1}, "population_size must be >= 2"),
        ({"sigma": 0.0}, "sigma must be > 0"),
        ({"sigma": -1.0}, "sigma must be > 0"),
        ({"antithetic": True, "population_size": 5}, "antithetic=True needs an even population_size"),
        ({"fitness_shaping": "softmax"}, "fitness_shaping must be one of"),
        ({"es_optimizer": "sgd"}, "es_optimizer must be one of"),
        ({"awd_penalty": "l3"}, "awd_penalty must be one of"),
        ({"awd_lambda": 10.0, "learning_rate": 0.2}, "learning_rate \\* awd_lambda < 1"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"noise_table_size": 10}, "noise_table_size must be 0 or"),
    ],
)
def test_config_errors_name_the_field(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        es_args(tmp_path, **kwargs)


# ---------------------------------------------------------------------------------------------- training
def test_learning_raises_reward(tmp_path, tokenizer):
    """With fixed seeds, ES raises the share of 'a' in greedy completions of a random tiny Llama."""
    args = es_args(tmp_path, max_steps=10, population_size=8, antithetic=True, prompt_batch_size=8,
                   max_completion_length=8)
    trainer = ESTrainer(build_llama(tokenizer), share_a, args=args, train_dataset=prompts(32),
                        eval_dataset=prompts(16, offset=100), processing_class=tokenizer)
    before = trainer.evaluate()["eval_reward"]
    trainer.train()
    after = trainer.evaluate()["eval_reward"]
    assert before < 0.05
    assert after > before + 0.3
    assert len(trainer.seed_log.records) == 10 and trainer.state.global_step == 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_steps_updates_and_replay_is_bitwise(tmp_path, tokenizer, dtype):
    model = build_llama(tokenizer, dtype=dtype)
    base = snapshot(model)
    args = es_args(tmp_path, max_steps=3, antithetic=True, fitness_shaping="centered_rank")
    trainer = ESTrainer(model, mean_code, args=args, train_dataset=prompts(8, conversational=True),
                        processing_class=tokenizer)
    trainer.train()
    assert trainer.state.global_step == 3
    log_path = os.path.join(args.output_dir, SEED_LOG_NAME)
    records = [json.loads(line) for line in open(log_path)][1:]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(len(r["members"]) == 4 for r in records)
    trained = snapshot(trainer.model)
    assert_changed(trained, base)
    fresh = build_llama(tokenizer, dtype=dtype)
    assert_bitwise(snapshot(fresh), base)
    replay(fresh, args.output_dir)
    assert_bitwise(snapshot(fresh), trained)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_training_on_cuda_replays_bitwise(tmp_path, tokenizer):
    model = build_llama(tokenizer, dtype=torch.bfloat16)
    base = snapshot(model)
    args = es_args(tmp_path, max_steps=2, antithetic=True)
    trainer = ESTrainer(model, mean_code, args=args, train_dataset=prompts(8, conversational=True),
                        processing_class=tokenizer)
    trainer.train()
    assert next(trainer.model.parameters()).is_cuda
    trained = snapshot(trainer.model)
    assert_changed(trained, base)
    fresh = build_llama(tokenizer, dtype=torch.bfloat16).cuda()
    replay(fresh, args.output_dir)
    assert_bitwise(snapshot(fresh), trained)


def test_equal_fitness_gives_zero_update(tmp_path, tokenizer):
    model = build_llama(tokenizer)
    base = snapshot(model)
    trainer = ESTrainer(model, lambda completions, **kw: [1.0] * len(completions), args=es_args(tmp_path),
                        train_dataset=prompts(), processing_class=tokenizer)
    trainer.train()
    assert_bitwise(snapshot(trainer.model), base)
    assert all(set(r["coefficients"]) == {0.0} for r in trainer.seed_log.records)


def test_rewards_see_completion_only_and_extra_columns(tmp_path, tokenizer):
    seen = {}

    def spy(prompts, completions, completion_ids, target, trainer_state, **kwargs):
        seen.setdefault("calls", 0)
        seen["calls"] += 1
        seen["prompts"], seen["completions"], seen["ids"], seen["target"] = prompts, completions, completion_ids, target
        return [0.0] * len(completions)

    data = Dataset.from_dict({"prompt": [f"Write: {i}" for i in range(4)], "target": list(range(4))})
    trainer = ESTrainer(build_llama(tokenizer), spy, args=es_args(tmp_path, max_steps=1, num_generations=2,
                                                                   temperature=1.0),
                        train_dataset=data, processing_class=tokenizer)
    trainer.train()
    assert seen["calls"] == 4  # one call per member
    assert len(seen["completions"]) == 8  # 4 prompts x 2 generations
    assert sorted(seen["target"]) == sorted(2 * list(range(4)))
    for prompt, completion, ids in zip(seen["prompts"], seen["completions"], seen["ids"]):
        assert not completion.startswith(prompt)
        assert tokenizer.decode(ids, skip_special_tokens=True) == completion
        assert len(ids) <= 6


def test_reward_weights_and_none_rewards(tmp_path, tokenizer):
    def half(completions, **kw):
        return [0.5] * len(completions)

    def none_reward(completions, **kw):
        return [None] * len(completions)

    trainer = ESTrainer(build_llama(tokenizer), [half, none_reward], args=es_args(tmp_path, reward_weights=[2.0, 1.0]),
                        train_dataset=prompts(), eval_dataset=prompts(4, offset=50), processing_class=tokenizer)
    metrics = trainer.evaluate()
    assert metrics["eval_reward"] == pytest.approx(1.0)
    assert metrics["eval_rewards/half/mean"] == pytest.approx(0.5)
    assert "eval_rewards/none_reward/mean" not in metrics


def test_logs_and_eval(tmp_path, tokenizer):
    trainer = ESTrainer(build_llama(tokenizer), share_a, args=es_args(tmp_path, max_steps=2, eval_strategy="steps",
                        eval_steps=2), train_dataset=prompts(), eval_dataset=prompts(4, offset=9),
                        processing_class=tokenizer)
    trainer.train()
    train_logs = [h for h in trainer.state.log_history if "reward" in h]
    assert [h["step"] for h in train_logs] == [1, 2]
    for key in ("reward_std", "reward_min", "reward_max", "rewards/share_a/mean", "time/generation_and_reward",
                "time/perturb", "time/restore", "time/update", "completions_per_second", "drift/l2"):
        assert key in train_logs[0], key
    assert train_logs[0]["reward_min"] <= train_logs[0]["reward"] <= train_logs[0]["reward_max"]
    assert any("eval_reward" in h for h in trainer.state.log_history)


@pytest.mark.parametrize("sampling", [{}, {"num_generations": 2, "temperature": 1.0}], ids=["greedy", "sampled"])
def test_evaluation_during_training_leaves_the_trajectory_bitwise(tmp_path, tokenizer, sampling):
    """evaluate() before train and an evaluation every iteration (TRL's workflow) change neither the weights nor the
    seed log: the studies that skip evaluations compare with runs that make them."""
    runs = {}
    for name, extra in (("plain", {}), ("evaluated", {"eval_strategy": "steps", "eval_steps": 1})):
        trainer = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path / name, max_steps=3, **sampling,
                            **extra), train_dataset=prompts(), eval_dataset=prompts(3, offset=9),
                            processing_class=tokenizer)
        if extra:
            trainer.evaluate()
        trainer.train()
        runs[name] = trainer
    assert sum("eval_reward" in h for h in runs["evaluated"].state.log_history) == 3  # train() starts a new history
    assert_changed(snapshot(runs["plain"].model), snapshot(build_llama(tokenizer)))
    assert_bitwise(snapshot(runs["evaluated"].model), snapshot(runs["plain"].model))
    assert runs["evaluated"].seed_log.records == runs["plain"].seed_log.records


def test_checkpoint_loads_and_resume_matches_uninterrupted(tmp_path, tokenizer):
    data = prompts(8, conversational=True)
    full = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path / "full", max_steps=4),
                     train_dataset=data, processing_class=tokenizer)
    full.train()

    args = es_args(tmp_path / "resumed", max_steps=4, save_strategy="steps", save_steps=2)
    first = ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=data, processing_class=tokenizer)
    first.train()
    checkpoint = os.path.join(args.output_dir, "checkpoint-2")
    assert os.path.exists(os.path.join(checkpoint, SEED_LOG_NAME))
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert_bitwise(snapshot(replay(build_llama(tokenizer), checkpoint)), snapshot(loaded))

    resumed = ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=data, processing_class=tokenizer)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.state.global_step == 4
    assert_bitwise(snapshot(resumed.model), snapshot(full.model))
    assert [r["step"] for r in resumed.seed_log.records] == [1, 2, 3, 4]


def test_torch_optimizer_path(tmp_path, tokenizer):
    model = build_llama(tokenizer)
    base = snapshot(model)
    es = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path / "es", max_steps=2), train_dataset=prompts(),
                   processing_class=tokenizer)
    es.train()
    sgd = ESTrainer(model, mean_code, args=es_args(tmp_path / "sgd", max_steps=2, es_optimizer="torch", optim="sgd"),
                    train_dataset=prompts(), processing_class=tokenizer)
    sgd.train()
    # SGD on the ES gradient estimate reproduces the reference update (to fp32 rounding).
    for (name, a), b in zip(snapshot(es.model).items(), snapshot(sgd.model).values()):
        assert torch.allclose(a, b, atol=1e-6), name
    adam = ESTrainer(build_llama(tokenizer), mean_code,
                     args=es_args(tmp_path / "adam", max_steps=2, es_optimizer="torch", learning_rate=1e-3),
                     train_dataset=prompts(), processing_class=tokenizer)
    adam.train()
    assert_changed(snapshot(adam.model), base)
    assert len(adam.optimizer.state) > 0  # AdamW state exists for the fp32 masters


def test_peft_perturbs_adapter_only(tmp_path, tokenizer):
    from peft import LoraConfig

    model = build_qwen2(tokenizer)
    base = snapshot(model)
    trainer = ESTrainer(model, mean_code, args=es_args(tmp_path, max_steps=2, sigma=0.1, learning_rate=0.1),
                        train_dataset=prompts(), processing_class=tokenizer,
                        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    names = [e.name for e in trainer.es_params.entries]
    assert names and all("lora_" in n for n in names)
    trainer.train()
    state = snapshot(trainer.model)
    for key, value in base.items():  # base weights untouched
        peft_key = "base_model.model." + re.sub(r"(q_proj|v_proj)\.", r"\1.base_layer.", key)
        assert torch.equal(state[peft_key], value), key
    assert any(not torch.equal(state[n], trainer.anchor[n].cpu()) for n in names)


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "data, message",
    [
        (Dataset.from_dict({"question": ["a", "b"]}), "must have a 'prompt' column"),
        (Dataset.from_dict({"prompt": []}), "is empty"),
    ],
)
def test_bad_dataset(tmp_path, tokenizer, data, message):
    with pytest.raises(ValueError, match=message):
        ESTrainer(build_llama(tokenizer), share_a, args=es_args(tmp_path), train_dataset=data,
                  processing_class=tokenizer)


def wrong_count(completions, **kwargs):
    return [0.0]


def not_numbers(completions, **kwargs):
    return ["good"] * len(completions)


class Interrupt:
    __name__ = "interrupt"

    def __init__(self):
        self.calls = 0

    def __call__(self, completions, **kwargs):
        self.calls += 1
        if self.calls == 3:
            raise KeyboardInterrupt
        return share_a(completions)


@pytest.mark.parametrize(
    "reward, error, message",
    [
        (wrong_count, ValueError, "returned 1 rewards, but 4 were expected"),
        (not_numbers, TypeError, "expected a number"),
        (Interrupt(), KeyboardInterrupt, "^$"),  # the bare interrupt propagates as raised
    ],
)
def test_failing_reward_leaves_weights_unchanged(tmp_path, tokenizer, reward, error, message):
    model = build_llama(tokenizer, dtype=torch.bfloat16)
    base = snapshot(model)
    trainer = ESTrainer(model, reward, args=es_args(tmp_path), train_dataset=prompts(), processing_class=tokenizer)
    with pytest.raises(error, match=message):
        trainer.train()
    assert_bitwise(snapshot(trainer.model), base)
    assert trainer.seed_log.records == []


def test_generation_error_leaves_weights_unchanged(tmp_path, tokenizer, monkeypatch):
    model = build_llama(tokenizer)
    base = snapshot(model)
    trainer = ESTrainer(model, share_a, args=es_args(tmp_path), train_dataset=prompts(), processing_class=tokenizer)

    def broken_generate(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(model, "generate", broken_generate)
    with pytest.raises(RuntimeError, match="simulated"):
        trainer.train()
    assert_bitwise(snapshot(trainer.model), base)


def test_nan_member_is_ranked_worst(tmp_path, tokenizer, caplog):
    calls = {"n": 0}

    def sometimes_none(completions, **kwargs):
        calls["n"] += 1
        return [None] * len(completions) if calls["n"] == 2 else mean_code(completions)

    trainer = ESTrainer(build_llama(tokenizer), sometimes_none, args=es_args(tmp_path, max_steps=1),
                        train_dataset=prompts(), processing_class=tokenizer)
    trainer.train()
    coefficients = trainer.seed_log.records[0]["coefficients"]
    assert coefficients[1] == min(coefficients)
    assert "no finite fitness" in caplog.text
    assert trainer.state.log_history[0]["num_nan_members"] == 1


def test_reward_weights_length_error(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="reward_weights has 2 entries"):
        ESTrainer(build_llama(tokenizer), share_a, args=es_args(tmp_path, reward_weights=[1.0, 2.0]),
                  train_dataset=prompts(), processing_class=tokenizer)


# ---------------------------------------------------------------------------------------------- TRL compatibility
def test_same_dataset_and_reward_run_in_grpo_and_es(tmp_path, tokenizer):
    from trl import GRPOConfig, GRPOTrainer

    data = prompts(8, conversational=True)
    grpo = GRPOTrainer(
        model=build_llama(tokenizer), reward_funcs=share_a, train_dataset=data, processing_class=tokenizer,
        args=GRPOConfig(output_dir=str(tmp_path / "grpo"), bf16=False, max_steps=1, per_device_train_batch_size=4,
                        num_generations=2, max_completion_length=6, report_to=[], save_strategy="no",
                        disable_tqdm=True),
    )
    grpo.train()
    assert grpo.state.global_step == 1
    es = ESTrainer(model=build_llama(tokenizer), reward_funcs=share_a, train_dataset=data, processing_class=tokenizer,
                   args=es_args(tmp_path / "es", max_steps=1))
    es.train()
    assert es.state.global_step == 1
    assert "rewards/share_a/mean" in es.state.log_history[0]
    assert any(k.startswith("rewards/share_a") for k in grpo.state.log_history[0])


def test_reward_model_is_accepted(tmp_path, tokenizer):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    reward_model = LlamaForSequenceClassification(config)
    trainer = ESTrainer(build_llama(tokenizer), [reward_model, share_a], args=es_args(tmp_path, max_steps=1),
                        train_dataset=prompts(), eval_dataset=prompts(4, offset=20), processing_class=tokenizer,
                        reward_processing_classes=[tokenizer, None])
    metrics = trainer.evaluate()
    # The reward model scores prompt + completion (as GRPOTrainer does); check against a direct forward.
    rows = [prompts(4, offset=20)[i] for i in range(4)]
    from trl_es.rollout import generate_completions, prompt_texts

    texts, _ = generate_completions(trainer.model, tokenizer, prompt_texts(rows, tokenizer), trainer.generation_config)
    inputs = tokenizer([r["prompt"] + t for r, t in zip(rows, texts)], return_tensors="pt", padding=True,
                       padding_side="right", add_special_tokens=False).to(reward_model.device)
    with torch.no_grad():
        expected = reward_model(**inputs).logits[:, 0].mean().item()
    assert metrics["eval_rewards/LlamaForSequenceClassification/mean"] == pytest.approx(expected, abs=1e-5)
    trainer.train()
    assert trainer.state.global_step == 1


def test_success_diversity_and_module_drift_are_logged(tmp_path, tokenizer):
    import math

    calls = {"n": 0}
    per_member = {1: [1.0] * 4, 2: [0.0] * 4, 3: [1.0, 0.0, 1.0, 0.0], 4: [0.0, 1.0, 0.0, 1.0]}

    def scripted(completions, **kwargs):  # member i (in scoring order) succeeds on a known share of prompts
        calls["n"] += 1
        return per_member[calls["n"]]

    trainer = ESTrainer(build_llama(tokenizer), scripted, args=es_args(tmp_path, max_steps=1, log_module_drift=True),
                        train_dataset=prompts(), processing_class=tokenizer)
    trainer.train()
    logs = trainer.state.log_history[0]
    # p = [1, 0, 0.5, 0.5]: JS_succ = h(0.5) - mean h(p_i) = ln 2 - (ln 2 + ln 2) / 4 = ln 2 / 2
    assert logs["success_rate"] == pytest.approx(0.5)
    assert logs["success_diversity"] == pytest.approx(math.log(2) / 2)
    for group in ("q_proj", "down_proj", "embed_tokens", "lm_head", "norm"):
        assert f"drift/l2/{group}" in logs and f"drift/relative/{group}" in logs
    per_group_sq = sum(v ** 2 for k, v in logs.items() if k.startswith("drift/l2/"))
    assert per_group_sq == pytest.approx(logs["drift/l2"] ** 2)


# ---------------------------------------------------------------------------------------------- fitness robustness
def test_tied_fitness_is_an_exactly_zero_step(tmp_path, tokenizer):
    """Population 30 on 3 prompts, a reward that is 1 for one prompt and 0 for the other two: every member's fitness
    is 1/3 (not a dyadic number), the step must be exactly zero (it used to be a full random step)."""
    def first_prompt_only(prompts, completions, **kwargs):
        return [1.0 if p.endswith("Write: 0") else 0.0 for p in prompts]

    model = build_llama(tokenizer)
    base = snapshot(model)
    trainer = ESTrainer(model, first_prompt_only, args=es_args(tmp_path, max_steps=1, population_size=30,
                                                               prompt_batch_size=3, dataloader_drop_last=True),
                        train_dataset=prompts(3), processing_class=tokenizer)
    trainer.train()
    record = trainer.seed_log.records[0]
    assert record["coefficients"] == [0.0] * 30
    assert_bitwise(snapshot(trainer.model), base)
    assert trainer.state.log_history[0]["drift/l2"] == 0.0
    assert trainer.state.log_history[0]["reward"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("shaping", ["zscore", "centered_rank", "none"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_rewards_never_reach_the_weights(tmp_path, tokenizer, shaping, bad):
    calls = {"n": 0}

    def sometimes_bad(completions, **kwargs):
        calls["n"] += 1
        rewards = mean_code(completions)
        if calls["n"] % 4 == 2:  # the second member of every iteration
            rewards[1] = bad
        return rewards

    trainer = ESTrainer(build_llama(tokenizer), sometimes_bad,
                        args=es_args(tmp_path, max_steps=2, fitness_shaping=shaping, sigma=0.1, learning_rate=0.1),
                        train_dataset=prompts(), processing_class=tokenizer)
    with pytest.warns(UserWarning, match="'sometimes_bad' returned a non-finite reward") as caught:
        trainer.train()
    assert sum("non-finite reward" in str(w.message) for w in caught) == 1  # once per reward function
    assert all(torch.isfinite(v).all() for v in snapshot(trainer.model).values())
    logs = [h for h in trainer.state.log_history if "num_nan_members" in h]
    assert [h["num_nan_members"] for h in logs] == [1.0, 1.0]
    assert [h["num_invalid_rewards"] for h in logs] == [1.0, 1.0]
    for record in trainer.seed_log.records:  # the invalid member is ranked worst
        assert record["coefficients"][1] == min(record["coefficients"])
        assert all(math.isfinite(c) for c in record["coefficients"])


def test_evaluate_sums_invalid_rewards_by_the_training_rule(tmp_path, tokenizer):
    """evaluate() sums its rollouts with MemberScores: an invalid reward is skipped as a None is, a completion with no
    valid reward left has no weighted reward, and eval_reward is training's ``reward`` of the same rollout."""
    from trl_es.es.fitness import MemberScores

    def first(completions, **kwargs):  # completions 0..3: 1, inf, nan, None
        return [1.0, float("inf"), float("nan"), None][: len(completions)]

    def second(completions, **kwargs):  # 0.5, 0.25, None, 0.125
        return [0.5, 0.25, None, 0.125][: len(completions)]

    args = es_args(tmp_path, per_device_eval_batch_size=4, reward_weights=[1.0, 2.0])
    trainer = ESTrainer(build_llama(tokenizer), [first, second], args=args, train_dataset=prompts(),
                        eval_dataset=prompts(4, offset=20), processing_class=tokenizer)
    with pytest.warns(UserWarning, match="non-finite reward"):
        metrics = trainer.evaluate()
    # weighted: 1 + 2 * 0.5 = 2.0; 2 * 0.25 = 0.5 (inf skipped); none (nan invalid, None); 2 * 0.125 = 0.25
    assert metrics["eval_reward"] == (2.0 + 0.5 + 0.25) / 3 and metrics["eval_loss"] == -metrics["eval_reward"]
    assert metrics["eval_num_invalid_rewards"] == 2 and metrics["eval_num_completions"] == 4
    assert metrics["eval_rewards/first/mean"] == 1.0 and metrics["eval_rewards/second/mean"] == 0.875 / 3
    out = trainer.rollout(trainer.model, list(prompts(4, offset=20)))
    member = MemberScores.from_rollout(out, args.success_threshold)
    assert (member.reward_sum / member.reward_count, member.invalid) == (metrics["eval_reward"], 2)


def test_non_finite_reward_model_is_flagged_in_training_and_evaluation(tmp_path, tokenizer):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    reward_model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        reward_model.score.weight.fill_(float("inf"))  # every logit is +-inf or NaN
    trainer = ESTrainer(build_llama(tokenizer), [reward_model, share_a], args=es_args(tmp_path, max_steps=1),
                        train_dataset=prompts(), eval_dataset=prompts(4, offset=20), processing_class=tokenizer,
                        reward_processing_classes=[tokenizer, None])
    with pytest.warns(UserWarning, match="LlamaForSequenceClassification"):
        metrics = trainer.evaluate()
    # training's rule: the invalid reward is left out as a None is, the completion keeps share_a's (weight 1)
    assert metrics["eval_num_invalid_rewards"] == 4 and metrics["eval_reward"] == metrics["eval_rewards/share_a/mean"]
    assert metrics["eval_loss"] == -metrics["eval_reward"]
    assert "eval_rewards/LlamaForSequenceClassification/mean" not in metrics
    assert math.isfinite(metrics["eval_rewards/share_a/mean"])
    base = snapshot(trainer.model)
    trainer.train()
    assert trainer.state.log_history[0]["num_nan_members"] == 4.0
    assert trainer.seed_log.records[0]["coefficients"] == [0.0] * 4  # no member has a fitness: no step
    assert_bitwise(snapshot(trainer.model), base)


def test_evaluate_batches_by_per_device_eval_batch_size(tmp_path, tokenizer):
    batches = []

    def counting(completions, **kwargs):
        batches.append(len(completions))
        return [0.0] * len(completions)

    trainer = ESTrainer(build_llama(tokenizer), counting,
                        args=es_args(tmp_path, prompt_batch_size=2, per_device_eval_batch_size=4),
                        train_dataset=prompts(), eval_dataset=prompts(10, offset=20), processing_class=tokenizer)
    metrics = trainer.evaluate()
    assert batches == [4, 4, 2]
    assert metrics["eval_num_completions"] == 10 and metrics["eval_reward"] == 0.0


# ---------------------------------------------------------------------------------------------- memory options
def test_anchor_is_read_from_the_base_checkpoint_file(tmp_path, tokenizer, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from trl_es.es.anchor import FileAnchor, MemoryAnchor

    for dtype in (torch.float32, torch.bfloat16):  # bf16: the fp32 file cast to bf16 is the model
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
        trainer = ESTrainer(model, mean_code, args=es_args(tmp_path / str(dtype), max_steps=1), train_dataset=prompts(),
                            processing_class=tokenizer)
        assert isinstance(trainer.anchor, FileAnchor) and trainer.anchor.resident_bytes == 0
        base = snapshot(model)
        for name in trainer.es_params.names:
            assert trainer.anchor[name].dtype == dtype and torch.equal(trainer.anchor[name], base[name])
        trainer.train()
        assert trainer.state.log_history[0]["drift/l2"] > 0
    memory = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path / "mem", anchor_storage="memory"),
                       train_dataset=prompts(), processing_class=tokenizer)
    assert isinstance(memory.anchor, MemoryAnchor)
    assert memory.anchor.resident_bytes == sum(p.numel() * 4 for p in memory.model.parameters())


def test_lean_memory_holds_no_table_and_no_resident_anchor(tmp_path, tokenizer):
    from trl_es.es.noise import GaussianNoise

    args = es_args(tmp_path, lean_memory=True, noise_table_size=1 << 26)
    trainer = ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=prompts(),
                        processing_class=tokenizer)
    assert isinstance(trainer.noise, GaussianNoise)  # no 256 MiB table
    assert trainer.anchor is None  # an in-memory model: theta_0 is in no file, so no drift logging
    trainer.train()
    assert "drift/l2" not in trainer.state.log_history[0]
    with pytest.warns(UserWarning, match="AWD keeps"):
        awd = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path / "awd", lean_memory=True,
                                                                         awd_lambda=1.0),
                        train_dataset=prompts(), processing_class=tokenizer)
    assert awd.anchor is not None


def test_saving_into_the_base_model_folder_keeps_theta_0(tmp_path, tokenizer, tiny_model_dir):
    """The default anchor reads theta_0 from the model's own file; saving the trained model over that file first
    moves theta_0 into memory, so drift and AWD still measure from the initial weights."""
    import shutil

    from transformers import AutoModelForCausalLM

    from trl_es.es.anchor import FileAnchor, MemoryAnchor

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    base = snapshot(model)
    trainer = ESTrainer(model, mean_code, args=es_args(tmp_path, output_dir=str(folder), max_steps=1, sigma=0.1,
                                                      learning_rate=0.1),
                        train_dataset=prompts(), processing_class=tokenizer)
    assert isinstance(trainer.anchor, FileAnchor)
    trainer.train()
    trainer.save_model()  # into the folder theta_0 was read from
    assert isinstance(trainer.anchor, MemoryAnchor)
    assert all(torch.equal(trainer.anchor[n], base[n]) for n in trainer.es_params.names)
    assert trainer._parameter_drift()["drift/l2"] > 0


def test_weighted_rewards_do_not_overflow(tmp_path, tokenizer):
    from trl_es.rollout import RewardScorer

    def big(completions, **kwargs):
        return [3e38] * len(completions)

    scorer = RewardScorer([big, big])
    rewards = scorer.weighted(scorer([{"prompt": "p"}] * 2, ["a", "b"], [[1], [2]]))
    expected = 2 * float(torch.tensor(3e38, dtype=torch.float32))  # the float32 reward, summed without overflow
    assert rewards.dtype == torch.float64 and rewards.tolist() == [expected, expected]
    with pytest.raises(ValueError, match="reward_weights must be finite"):
        RewardScorer([big], reward_weights=[float("nan")])
    import numpy as np

    def numpy_bools(completions, **kwargs):
        return [np.bool_(True), np.float32(0.5)]

    assert RewardScorer([numpy_bools])([{"prompt": "p"}] * 2, ["a", "b"], [[1], [2]]).tolist() == [[1.0], [0.5]]


# ---------------------------------------------------------------------------------------------- iterable datasets
class PromptLog:
    """A reward (mean_code) that records the distinct prompt batch of every training call, in order."""

    __name__ = "mean_code"

    def __init__(self):
        self.batches = []

    def __call__(self, prompts, completions, **kwargs):
        distinct = {}
        for prompt in prompts:  # a member's call repeats each prompt num_generations times
            distinct.setdefault(str(prompt), prompt)
        batch = [text(p) for p in distinct.values()]
        if not self.batches or self.batches[-1] != batch:
            self.batches.append(batch)
        return mean_code(completions)


@pytest.mark.parametrize("conversational", [False, True], ids=["standard", "conversational"])
def test_iterable_dataset_trains_in_stream_order(tmp_path, tokenizer, conversational):
    """TRL's trainers take a datasets.IterableDataset with max_steps; so does ESTrainer: the prompts come in stream
    order, and the run equals the same prompts given as a map-style dataset read sequentially, bitwise."""
    data = prompts(12, conversational=conversational)
    log = PromptLog()
    stream = ESTrainer(build_llama(tokenizer), log, args=es_args(tmp_path / "stream", max_steps=3),
                       train_dataset=data.to_iterable_dataset(), processing_class=tokenizer)
    stream.train()
    content = [f"Write: {i}" for i in range(12)]
    assert log.batches == [content[0:4], content[4:8], content[8:12]]
    assert stream.state.global_step == 3 and [r["step"] for r in stream.seed_log.records] == [1, 2, 3]

    sequential = ESTrainer(build_llama(tokenizer), mean_code,
                           args=es_args(tmp_path / "map", max_steps=3, train_sampling_strategy="sequential"),
                           train_dataset=data, processing_class=tokenizer)
    sequential.train()
    assert_bitwise(snapshot(stream.model), snapshot(sequential.model))
    assert_bitwise(snapshot(replay(build_llama(tokenizer), str(tmp_path / "stream" / "out"))), snapshot(stream.model))


def test_iterable_dataset_resume_keeps_its_place_in_the_stream(tmp_path, tokenizer):
    data = prompts(16, conversational=True).to_iterable_dataset()
    full_log = PromptLog()
    full = ESTrainer(build_llama(tokenizer), full_log, args=es_args(tmp_path / "full", max_steps=4),
                     train_dataset=data, processing_class=tokenizer)
    full.train()
    assert len(full_log.batches) == 4

    args = es_args(tmp_path / "resumed", max_steps=4, save_strategy="steps", save_steps=2)
    ESTrainer(build_llama(tokenizer), PromptLog(), args=args, train_dataset=data, processing_class=tokenizer).train()
    resumed_log = PromptLog()
    resumed = ESTrainer(build_llama(tokenizer), resumed_log, args=args, train_dataset=data, processing_class=tokenizer)
    resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-2"))
    assert resumed_log.batches == full_log.batches[2:]  # iterations 3 and 4 read the stream's batches 3 and 4
    assert_bitwise(snapshot(resumed.model), snapshot(full.model))


@pytest.mark.parametrize(
    "data, kwargs, message",
    [
        (Dataset.from_dict({"prompt": ["a", "b"]}), {"max_steps": -1, "num_train_epochs": 1},
         "iterable .* set max_steps"),
        (None, {}, "is an empty iterable dataset"),
        (Dataset.from_dict({"question": ["a"]}), {}, "must have a 'prompt' column"),
        (Dataset.from_dict({"prompt": ["a"]}), {"accelerator_config": {"dispatch_batches": True}},
         "dispatch_batches=True cannot dispatch"),
    ],
    ids=["no_max_steps", "empty", "no_prompt", "dispatch_batches"],
)
def test_bad_iterable_dataset(tmp_path, tokenizer, data, kwargs, message):
    from datasets import IterableDataset

    def nothing():
        yield from ()

    stream = IterableDataset.from_generator(nothing) if data is None else data.to_iterable_dataset()
    with pytest.raises(ValueError, match=message):
        ESTrainer(build_llama(tokenizer), share_a, args=es_args(tmp_path, **kwargs), train_dataset=stream,
                  processing_class=tokenizer)


def test_iterable_rows_without_declared_columns_are_checked_on_the_first_row(tmp_path, tokenizer):
    from datasets import IterableDataset

    def rows():
        yield {"question": "a"}

    with pytest.raises(ValueError, match="must yield rows with a 'prompt' field.*\\['question'\\]"):
        ESTrainer(build_llama(tokenizer), share_a, args=es_args(tmp_path),
                  train_dataset=IterableDataset.from_generator(rows), processing_class=tokenizer)


def test_iterable_eval_dataset_equals_map_style(tmp_path, tokenizer):
    data = prompts(6, offset=20)
    trainer = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path), train_dataset=prompts(),
                        processing_class=tokenizer)
    as_map = trainer.evaluate(data)
    as_stream = trainer.evaluate(data.to_iterable_dataset())
    assert as_stream["eval_reward"] == as_map["eval_reward"] and as_stream["eval_num_completions"] == 6


def test_save_model_fails_loudly_when_save_pretrained_writes_nothing(tmp_path, tokenizer, monkeypatch):
    """transformers 5 ``save_pretrained`` skips silently on a torch.distributed rank != 0 (``save_on_each_node`` on a
    second node): ESTrainer.save_model raises instead of leaving a folder without weights (and writes no seed log
    beside nothing)."""
    model = build_llama(tokenizer)
    trainer = ESTrainer(model, share_a, args=es_args(tmp_path, max_steps=1), train_dataset=prompts(),
                        processing_class=tokenizer)
    trainer.train()
    monkeypatch.setattr(type(model), "should_save_on_this_rank", lambda self, is_main_process: False)
    folder = tmp_path / "saved"
    with pytest.raises(RuntimeError, match=r"the model saved by ESTrainer .* is incomplete: \['model.safetensors"):
        trainer.save_model(str(folder))
    assert not (folder / SEED_LOG_NAME).exists()
    monkeypatch.undo()
    trainer.save_model(str(folder))
    assert (folder / "model.safetensors").is_file() and (folder / SEED_LOG_NAME).is_file()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"save_on_each_node": True}, "save_on_each_node=True is not supported"),
        ({"es_optimizer": "torch", "fp16": True}, "fp16=True cannot go with es_optimizer='torch'"),
        ({"es_optimizer": "torch", "optim": "schedule_free_adamw"}, "cannot go with es_optimizer='torch'"),
    ],
    ids=["save_on_each_node", "fp16_torch", "schedule_free_torch"],
)
def test_config_refuses_what_the_es_save_and_step_cannot_honour(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        es_args(tmp_path, **kwargs)


def test_checkpoint_without_its_fp32_master_is_refused(tmp_path, tokenizer):
    """A bf16 model's checkpoint must hold its fp32 master (written before trainer_state.json marks the checkpoint):
    resuming from one without it raises instead of silently restarting the master from the bf16 weights."""
    from trl_es.trainer.es.es_checkpoint import MASTER_WEIGHTS_NAME

    args = es_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    ESTrainer(build_llama(tokenizer, dtype=torch.bfloat16), mean_code, args=args, train_dataset=prompts(),
              processing_class=tokenizer).train()
    checkpoint = os.path.join(args.output_dir, "checkpoint-1")
    assert os.path.isfile(os.path.join(checkpoint, MASTER_WEIGHTS_NAME))
    os.remove(os.path.join(checkpoint, MASTER_WEIGHTS_NAME))
    resumed = ESTrainer(build_llama(tokenizer, dtype=torch.bfloat16), mean_code, args=args, train_dataset=prompts(),
                        processing_class=tokenizer)
    with pytest.raises(ValueError, match="holds no es_master.safetensors"):
        resumed.train(resume_from_checkpoint=checkpoint)


def test_es_optimizer_logs_a_zero_grad_norm_when_clipping_is_on(tmp_path, tokenizer):
    trainer = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path, max_steps=1, max_grad_norm=1.0),
                        train_dataset=prompts(), processing_class=tokenizer)
    trainer.train()
    assert [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h] == [0.0]
