"""The continuous-batching engine (transformers' generate_batch, GRPO's use_transformers_continuous_batching) on the
CPU: greedy tokens equal the eager engine's, sampling seeded from the caller's generator, what it cannot do refused."""

import pytest
import torch
from datasets import Dataset
from tiny import build_llama, build_qwen2
from tiny_tools import multiply_tool, tool_model, tool_tokenizer

from trl_es import ESConfig, ESTrainer, replay
from trl_es.generation import ContinuousBatchingEngine, EagerEngine, make_engine
from trl_es.rewards import completion_text
from trl_es.rollout import build_generation_config


def prompts_of_different_lengths(tokenizer):
    """Chat prompts of 15 to 40 tokens, and a plain one: every row has its own length."""
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                          add_generation_prompt=True)
            for text in ("Hi", "What is 2+3? Answer:", "a much longer prompt, with many characters in it")]
    return chat + ["x"]


@pytest.mark.parametrize("build", [build_llama, build_qwen2])
def test_greedy_tokens_equal_the_eager_engines(tokenizer, one_thread, build):
    model = build(tokenizer).eval()
    prompts = prompts_of_different_lengths(tokenizer)
    config = build_generation_config(tokenizer, 10)
    eager = EagerEngine().generate(model, tokenizer, prompts, config, num_generations=2)
    batched = ContinuousBatchingEngine().generate(model, tokenizer, prompts, config, num_generations=2)
    assert len({len(tokenizer(p).input_ids) for p in prompts}) == len(prompts)
    assert batched.ids == eager.ids and batched.texts == eager.texts
    assert len(batched.ids) == 8 and batched.ids[::2] == batched.ids[1::2]  # 4 prompts, 2 greedy copies each
    assert len({str(i) for i in batched.ids}) > 1  # the prompts really produce different completions


def test_sampling_follows_the_callers_seed_and_leaves_its_generator_alone(tokenizer, one_thread):
    model = build_llama(tokenizer).eval()
    prompts = prompts_of_different_lengths(tokenizer)[:2]
    config = build_generation_config(tokenizer, 8, temperature=1.0)
    engine = ContinuousBatchingEngine()

    def sample(seed):
        torch.manual_seed(seed)
        ids = engine.generate(model, tokenizer, prompts, config, num_generations=3).ids
        return ids, torch.rand(1).item()  # the caller's generator after the call

    first, after_first = sample(1)
    again, after_again = sample(1)
    other, after_other = sample(2)
    assert first == again and first != other
    assert len({str(i) for i in first}) == 6  # every row draws its own completion
    torch.manual_seed(1)
    torch.randint(2**31 - 1, ())  # the engine draws the sampling seed, nothing else
    assert after_first == after_again == torch.rand(1).item()
    torch.manual_seed(2)
    torch.randint(2**31 - 1, ())
    assert after_other == torch.rand(1).item()


def test_greedy_leaves_the_callers_generator_untouched(tokenizer, one_thread):
    model = build_llama(tokenizer).eval()
    torch.manual_seed(5)
    ContinuousBatchingEngine().generate(model, tokenizer, ["ab", "abc"], build_generation_config(tokenizer, 4))
    after = torch.rand(1).item()
    torch.manual_seed(5)
    assert after == torch.rand(1).item()


def test_a_member_perturbed_in_place_is_what_it_generates(tokenizer, one_thread):
    model = build_llama(tokenizer).eval()
    prompts = prompts_of_different_lengths(tokenizer)
    config = build_generation_config(tokenizer, 8)
    engine = ContinuousBatchingEngine()
    base = engine.generate(model, tokenizer, prompts, config).ids
    weight = model.model.layers[0].mlp.down_proj.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
    perturbed = engine.generate(model, tokenizer, prompts, config).ids
    assert perturbed == EagerEngine().generate(model, tokenizer, prompts, config).ids
    assert perturbed != base
    with torch.no_grad():
        weight.copy_(saved)
    assert engine.generate(model, tokenizer, prompts, config).ids == base


def test_what_it_cannot_do_is_refused_by_name(tokenizer):
    model = build_llama(tokenizer).eval()
    engine = make_engine("continuous_batching", model, continuous_batching_config={"use_cuda_graph": False})
    assert isinstance(engine, ContinuousBatchingEngine)
    assert engine.describe() == {"name": "continuous_batching", "config": {"use_cuda_graph": False}}
    config = build_generation_config(tokenizer, 4)
    with pytest.raises(ValueError, match=r"one member a call \(num_row_groups=1\), got num_row_groups=2"):
        engine.generate(model, tokenizer, ["a", "b"], config, num_row_groups=2)
    with pytest.raises(ValueError, match=r"no generate keyword arguments, got \['synced_gpus'\]"):
        engine.generate(model, tokenizer, ["a"], config, synced_gpus=True)
    for kwargs, named in (({"repetition_penalty": 1.3}, "RepetitionPenaltyLogitsProcessor"),
                          ({"min_new_tokens": 2}, "min_new_tokens"),
                          ({"no_repeat_ngram_size": 2}, "no_repeat_ngram_size")):
        with pytest.raises(ValueError, match=rf"does not apply {named}"):
            engine.generate(model, tokenizer, ["a"], build_generation_config(tokenizer, 4, generation_kwargs=kwargs))
    for bad, match in (({"seed": 3}, "remove 'seed'"), ({"pages": 3}, "not a valid ContinuousBatchingConfig"),
                       ("fast", "must be None or a dict")):
        with pytest.raises(ValueError, match=match):
            ContinuousBatchingEngine(bad)


# ---------------------------------------------------------------------------------------------- ESConfig / ESTrainer
def cb_args(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path / "out"), max_steps=2, population_size=4, antithetic=True,
                    prompt_batch_size=4, max_completion_length=6, sigma=0.05, learning_rate=0.05, report_to=[],
                    save_strategy="no", noise_table_size=1 << 20, disable_tqdm=True, seed=0)
    return ESConfig(**{**defaults, **kwargs})


def mean_code(completions, **kwargs):
    texts = [completion_text(c) for c in completions]
    return [sum(map(ord, t)) / (128 * max(1, len(t))) for t in texts]


def chat_data(n=8):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Write: {'ab' * (i % 3)}{i}"}]
                                         for i in range(n)]})


def train(tmp_path, tokenizer, name, reward=mean_code, **kwargs):
    trainer = ESTrainer(build_llama(tokenizer), reward, args=cb_args(tmp_path / name, **kwargs),
                        train_dataset=chat_data(), processing_class=tokenizer)
    trainer.train()
    return trainer


def test_greedy_training_takes_the_eager_engines_steps(tmp_path, tokenizer, one_thread):
    """The same completions give the same fitness, seed-log coefficients and weights; replay reproduces them."""
    eager = train(tmp_path, tokenizer, "eager", generation_engine="eager", share_prompt_prefix=False)
    batched = train(tmp_path, tokenizer, "cb", use_transformers_continuous_batching=True)
    assert batched.generation_engine.name == "continuous_batching"
    assert batched.args.generation_engine == "continuous_batching"
    coefficients = [r["coefficients"] for r in batched.seed_log.records]
    assert len(coefficients) == 2 and any(c != 0 for record in coefficients for c in record)
    assert coefficients == [r["coefficients"] for r in eager.seed_log.records]
    rewards = [log["reward"] for log in batched.state.log_history if "reward" in log]
    assert rewards == [log["reward"] for log in eager.state.log_history if "reward" in log] and len(rewards) == 2
    for (name, a), b in zip(batched.model.state_dict().items(), eager.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    fresh = build_llama(tokenizer)
    replay(fresh, batched.args.output_dir)
    for (name, a), b in zip(fresh.state_dict().items(), batched.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_each_member_is_restored_bitwise(tmp_path, tokenizer, one_thread):
    """Equal fitness is an exactly zero step: after every member the weights are the base weights again."""
    base = {k: v.clone() for k, v in build_llama(tokenizer).state_dict().items()}
    seen = []

    def constant(completions, **kwargs):
        seen.append(len(completions))
        return [0.5] * len(completions)

    trainer = train(tmp_path, tokenizer, "constant", reward=constant, use_transformers_continuous_batching=True)
    assert seen == [4] * 8  # 4 members x 2 steps, one call of 4 prompts each
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, base[name]), name


def test_sampled_training_is_seeded_per_member(tmp_path, tokenizer, one_thread):
    seen = {}

    def record(name):
        def reward(completions, completion_ids, **kwargs):
            seen.setdefault(name, []).append(completion_ids)
            return mean_code(completions)
        return reward

    sampled = dict(num_generations=2, temperature=1.0, max_steps=1, use_transformers_continuous_batching=True)
    runs = {name: train(tmp_path, tokenizer, name, reward=record(name), **sampled) for name in ("a", "b")}
    other = train(tmp_path, tokenizer, "c", reward=record("c"), seed=1, **sampled)
    assert seen["a"] == seen["b"] and seen["a"] != seen["c"]
    assert len({repr(ids) for ids in seen["a"]}) == 4  # every member samples its own completions
    assert [r["coefficients"] for r in runs["a"].seed_log.records] == \
        [r["coefficients"] for r in runs["b"].seed_log.records]
    assert other.state.global_step == 1


def test_config_fields_map_as_in_grpo(tmp_path):
    args = cb_args(tmp_path, use_transformers_continuous_batching=True,
                   transformers_continuous_batching_config='{"use_cuda_graph": false}')  # a JSON string, as a CLI
    assert args.generation_engine == "continuous_batching"
    assert args.transformers_continuous_batching_config == {"use_cuda_graph": False}
    assert cb_args(tmp_path, generation_engine="continuous_batching").use_transformers_continuous_batching is True
    with pytest.warns(FutureWarning, match="use_transformers_paged"):
        paged = cb_args(tmp_path, use_transformers_paged=True)
    assert paged.use_transformers_continuous_batching is True and paged.generation_engine == "continuous_batching"
    off = cb_args(tmp_path, transformers_continuous_batching_config={"max_memory_percent": 0.3})
    assert off.generation_engine == "auto" and not off.use_transformers_continuous_batching  # GRPO ignores it
    # set after parsing, as TRL's grpo_continuous_batching.py does: checked and mapped again
    late = cb_args(tmp_path)
    late.use_transformers_continuous_batching = True
    late.transformers_continuous_batching_config = {"use_cuda_graph": False}
    late.check_fields()
    assert late.generation_engine == "continuous_batching"


@pytest.mark.parametrize("kwargs, match", [
    (dict(use_vllm=True), r"use_transformers_continuous_batching=True and use_vllm=True name two generation engines"),
    (dict(generation_engine="eager"), r"contradicts generation_engine='eager'"),
    (dict(generation_engine="compiled"), r"contradicts generation_engine='compiled'"),
    (dict(population_backend="batched_lowrank"), r"population_backend='batched_lowrank'"),
    (dict(population_backend="batched_lowrank", member_chunk_size=1), r"population_backend='batched_lowrank'"),
    (dict(transformers_continuous_batching_config={"seed": 0}), r"remove 'seed'"),
    (dict(transformers_continuous_batching_config={"no_such_key": 1}), r"not a valid ContinuousBatchingConfig"),
])
def test_config_refuses_what_the_engine_cannot_do(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cb_args(tmp_path, use_transformers_continuous_batching=True, **kwargs)


def test_trainer_refuses_tools_zero3_and_dropped_generation_settings(tmp_path, tokenizer, monkeypatch):
    args = cb_args(tmp_path, use_transformers_continuous_batching=True)
    tokenizer_with_tools = tool_tokenizer()
    with pytest.raises(ValueError, match=r"not supported with tools, environment_factory or rollout_func"):
        ESTrainer(tool_model(tokenizer_with_tools), mean_code, args=args, train_dataset=chat_data(),
                  processing_class=tokenizer_with_tools, tools=[multiply_tool])
    for kwargs, named in ((dict(repetition_penalty=1.2), "RepetitionPenaltyLogitsProcessor"),
                          (dict(generation_kwargs={"min_new_tokens": 2}), "min_new_tokens")):
        with pytest.raises(ValueError, match=rf"does not apply {named}"):
            ESTrainer(build_llama(tokenizer), mean_code, processing_class=tokenizer, train_dataset=chat_data(),
                      args=cb_args(tmp_path, use_transformers_continuous_batching=True, **kwargs))
    monkeypatch.setattr("trl_es.trainer.es.es_distributed_setup.is_zero3_param", lambda param: True)  # ZeRO-3 params
    with pytest.raises(ValueError, match=r"not supported with DeepSpeed ZeRO-3"):
        ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=chat_data(), processing_class=tokenizer)
