"""The continuous-batching engine (transformers' generate_batch, GRPO's use_transformers_continuous_batching) on the
CPU: greedy tokens equal the eager engine's, sampling seeded from the caller's generator, what it cannot do refused."""

import pytest
import torch
from tiny import build_llama, build_qwen2

from trl_es.generation import ContinuousBatchingEngine, EagerEngine, make_engine
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
