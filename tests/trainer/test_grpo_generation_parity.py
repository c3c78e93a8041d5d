"""Generation as GRPOTrainer generates (issue 42, classes 2, 3, 8, 9, 10), in every engine and in evaluate():

2. plain-text prompts are tokenized with the tokenizer's special tokens (a post-processor's BOS), chat-templated
   ones without (GRPO's ``_tokenize_prompts``);
3. the decoding values are explicit: a model's own ``generation_config`` (``repetition_penalty=3.0``,
   ``do_sample=True``, ``top_k``) does not leak into ES's rollouts;
8. ``mask_truncated_completions`` with every completion cut leaves the weights bitwise as they were, with
   ``generation_kwargs={"min_new_tokens": ...}`` reaching every engine;
9. ``pad_to_multiple_of`` pads prompt batches to the multiple (masked), with the same completions;
10. sampling switched on by ``generation_kwargs={"do_sample": True}`` is seeded as ``temperature > 0`` is.
"""

import copy

import pytest
import torch
from datasets import Dataset
from tiny import build_llama, build_tokenizer
from tokenizers.processors import TemplateProcessing
from transformers import GenerationConfig

from trl_es import ESConfig, ESTrainer
from trl_es.generation import CompiledEngine, EagerEngine
from trl_es.generation.vllm_engine import sampling_kwargs, with_model_defaults
from trl_es.rollout import RewardScorer, build_generation_config, prompt_texts, score_model

pytestmark = pytest.mark.usefixtures("one_thread")

PLAIN = [f"Write {i}: " + "ab" * (i % 3) for i in range(4)]
CHAT = [[{"role": "user", "content": text}] for text in PLAIN]


def bos_tokenizer():
    """The tiny character tokenizer with a Llama-2 style post-processor that puts ``<s>`` before every text."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos = tokenizer.convert_tokens_to_ids("<s>")
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    assert tokenizer("ab")["input_ids"][0] == bos != tokenizer("ab", add_special_tokens=False)["input_ids"][0]
    return tokenizer


class Recorder:
    """A reward function that keeps every completion (text and ids) it scores."""

    __name__ = "recorder"

    def __init__(self):
        self.texts, self.ids = [], []

    def __call__(self, completions, completion_ids, **kwargs):
        self.texts += [c if isinstance(c, str) else c[0]["content"] for c in completions]
        self.ids += [list(i) for i in completion_ids]
        return [float(sum(i) % 7) for i in completion_ids]


def spy_generate(model):
    """Record the ``input_ids``/``attention_mask`` of every ``model.generate`` call (as CPU lists)."""
    calls, original = [], model.generate

    def generate(*args, **kwargs):
        calls.append({k: kwargs[k].tolist() for k in ("input_ids", "attention_mask") if k in kwargs})
        return original(*args, **kwargs)

    model.generate = generate
    return calls


def unpadded(call):
    return [[t for t, m in zip(ids, mask, strict=True) if m]
            for ids, mask in zip(call["input_ids"], call["attention_mask"], strict=True)]


def es_args(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path / "out"), max_steps=1, population_size=2, prompt_batch_size=4,
                    max_completion_length=6, sigma=0.02, learning_rate=0.02, report_to=[], save_strategy="no",
                    noise_table_size=1 << 20, disable_tqdm=True, seed=0, per_device_eval_batch_size=4)
    defaults.update(kwargs)
    return ESConfig(**defaults)


def evaluate_completions(model, tokenizer, tmp_path, prompts=PLAIN, calls=1, **kwargs):
    """``ESTrainer.evaluate()`` on ``prompts``, ``calls`` times: the completion ids of each call."""
    reward = Recorder()
    trainer = ESTrainer(model, reward, args=es_args(tmp_path, **kwargs), train_dataset=Dataset.from_dict(
        {"prompt": prompts}), eval_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer)
    out = []
    for _ in range(calls):
        reward.ids = []
        trainer.evaluate()
        out.append(reward.ids)
    return out if calls > 1 else out[0]


def engines():
    return {"eager": EagerEngine(), "eager_shared": EagerEngine(share_prompt_prefix=True, min_shared_prefix=2),
            "static": CompiledEngine(compile=False)}


# ---------------------------------------------------------------------------------------------- 2. special tokens
def test_plain_prompts_get_the_tokenizers_bos_as_in_grpo(tmp_path):
    tokenizer = bos_tokenizer()
    model = build_llama(tokenizer)
    calls = spy_generate(model)
    evaluate_completions(model, tokenizer, tmp_path)
    grpo = tokenizer(text=PLAIN)["input_ids"]  # GRPOTrainer._tokenize_prompts, plain text
    assert all(row[0] == tokenizer.bos_token_id for row in grpo)
    assert unpadded(calls[0]) == grpo


@pytest.mark.parametrize("name", ["eager", "eager_shared", "static"])
def test_every_engine_feeds_grpos_prompt_ids(name):
    tokenizer = bos_tokenizer()
    model = build_llama(tokenizer)
    calls = spy_generate(model)
    scorer = RewardScorer(Recorder())
    config = build_generation_config(tokenizer, 4, model_generation_config=model.generation_config)
    engine = engines()[name]
    rows = [{"prompt": p} for p in PLAIN]
    out = score_model(model, tokenizer, rows, scorer, config, engine=engine)
    grpo = tokenizer(text=PLAIN)["input_ids"]
    assert out.prompt_lengths == [len(ids) for ids in grpo]  # BOS counted
    if name == "eager_shared":  # the shared prefix ("<s>Write ") ran as a separate forward: rows hold it too
        assert engine.last_shared_prefix >= 2
    assert unpadded(calls[0])[: len(PLAIN)] == grpo
    # conversational prompts: the chat template's tokens only, as GRPO's apply_chat_template(tokenize=True)
    calls.clear()
    out = score_model(model, tokenizer, [{"prompt": p} for p in CHAT], scorer, config, engine=engines()[name])
    grpo = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert all(row[0] != tokenizer.bos_token_id for row in grpo)
    assert unpadded(calls[0])[: len(CHAT)] == grpo
    assert out.prompt_lengths == [len(ids) for ids in grpo]


def test_a_tokenizer_without_post_processor_is_unchanged(tmp_path, tokenizer):
    """The tiny test tokenizer (and SmolLM2's) adds nothing to plain text: the same ids as before."""
    assert tokenizer(text=PLAIN)["input_ids"] == tokenizer(text=PLAIN, add_special_tokens=False)["input_ids"]
    model = build_llama(tokenizer)
    calls = spy_generate(model)
    evaluate_completions(model, tokenizer, tmp_path)
    assert unpadded(calls[0]) == tokenizer(text=PLAIN, add_special_tokens=False)["input_ids"]
    calls.clear()
    evaluate_completions(model, tokenizer, tmp_path, prompts=CHAT)
    assert unpadded(calls[0]) == tokenizer(text=prompt_texts([{"prompt": p} for p in CHAT], tokenizer),
                                           add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------- 3. model config
def with_generation_config(tokenizer, **settings):
    model = build_llama(tokenizer)
    model.generation_config.update(**settings)
    return model


def test_a_models_repetition_penalty_does_not_leak(tmp_path, tokenizer):
    default = evaluate_completions(build_llama(tokenizer), tokenizer, tmp_path, max_completion_length=12)
    penalized = with_generation_config(tokenizer, repetition_penalty=3.0)
    # the penalty matters for this model: generate with its own config decodes otherwise
    inputs = tokenizer(PLAIN, return_tensors="pt", padding=True, padding_side="left")
    own = penalized.generate(**inputs, max_new_tokens=12, do_sample=False)
    plain = build_llama(tokenizer).generate(**inputs, max_new_tokens=12, do_sample=False)
    assert not torch.equal(own, plain)
    assert evaluate_completions(penalized, tokenizer, tmp_path, max_completion_length=12) == default
    # every HF engine, and the vLLM engine's sampling parameters
    rows = [{"prompt": p} for p in PLAIN]
    config = build_generation_config(tokenizer, 12, model_generation_config=penalized.generation_config)
    for engine in engines().values():
        out = score_model(penalized, tokenizer, rows, RewardScorer(Recorder()), config, engine=engine)
        assert out.completion_ids == default
    vllm = sampling_kwargs(with_model_defaults(config, penalized.generation_config), 1)[0]
    assert vllm["repetition_penalty"] == 1.0 and vllm["temperature"] == 0.0


def test_a_models_sampling_settings_do_not_leak(tmp_path, tokenizer):
    """A generation_config with do_sample=True, temperature=0.3, top_k=5: ES's greedy default stays greedy (the same
    completions as a default model, twice), and ES's sampling (temperature=1.0, top_k=0 as GRPO's) keeps no top-k."""
    sampling_model = with_generation_config(tokenizer, do_sample=True, temperature=0.3, top_k=5, top_p=0.5)
    greedy = evaluate_completions(build_llama(tokenizer), tokenizer, tmp_path)
    assert evaluate_completions(sampling_model, tokenizer, tmp_path, calls=2) == [greedy, greedy]
    sampled = evaluate_completions(build_llama(tokenizer), tokenizer, tmp_path, temperature=1.0)
    assert sampled != greedy
    assert evaluate_completions(sampling_model, tokenizer, tmp_path, temperature=1.0) == sampled
    config = build_generation_config(tokenizer, 6, 1.0, model_generation_config=sampling_model.generation_config)
    assert (config.do_sample, config.temperature, config.top_k, config.top_p, config.repetition_penalty) == (
        True, 1.0, 0, 1.0, 1.0)
    vllm = sampling_kwargs(with_model_defaults(config, sampling_model.generation_config), 1)[0]
    assert (vllm["temperature"], vllm["top_k"], vllm["top_p"]) == (1.0, 0, 1.0)


# ---------------------------------------------------------------------------------------------- 8. all masked
def eos_pad_tokenizer():
    """The tiny tokenizer with pad = EOS (as ESTrainer sets it for tokenizers without a pad token, and as most chat
    models ship): ``min_new_tokens`` then keeps every completion from ending."""
    tokenizer = copy.deepcopy(build_tokenizer())
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@pytest.mark.parametrize("backend", ["sequential", "batched_lowrank"])
def test_every_completion_masked_leaves_the_weights_bitwise(tmp_path, backend):
    tokenizer = eos_pad_tokenizer()
    model = build_llama(tokenizer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reward = Recorder()
    args = es_args(tmp_path, max_steps=2, population_size=4, max_completion_length=4, mask_truncated_completions=True,
                   generation_kwargs={"min_new_tokens": 4}, population_backend=backend)
    trainer = ESTrainer(model, reward, args=args, train_dataset=Dataset.from_dict({"prompt": PLAIN * 2}),
                        processing_class=tokenizer)
    trainer.train()
    assert reward.ids and all(len(ids) == 4 and tokenizer.eos_token_id not in ids for ids in reward.ids)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [h["num_nan_members"] for h in trainer.state.log_history if "num_nan_members" in h] == [4.0, 4.0]


def test_min_new_tokens_reaches_every_engine(tokenizer):
    """``generation_kwargs={"min_new_tokens": 4}`` holds off the EOS in every HF engine and in vLLM's parameters. A
    generated *pad* id still ends a completion (GRPO's ``eos_and_pad`` rule), which is why the all-masked test uses a
    tokenizer whose pad is its EOS."""
    model = build_llama(tokenizer)
    config = build_generation_config(tokenizer, 4, generation_kwargs={"min_new_tokens": 4},
                                     model_generation_config=model.generation_config)
    rows = [{"prompt": p} for p in PLAIN]
    for engine in engines().values():
        out = score_model(model, tokenizer, rows, RewardScorer(Recorder()), config, engine=engine)
        assert all(len(ids) == 4 and tokenizer.eos_token_id not in ids for ids in out.completion_ids)
        assert out.terminated == [ids[-1] in (tokenizer.eos_token_id, tokenizer.pad_token_id)
                                  for ids in out.completion_ids]
    assert sampling_kwargs(config, 1)[0]["min_tokens"] == 4


# ---------------------------------------------------------------------------------------------- 9. pad_to_multiple_of
@pytest.mark.parametrize("multiple", [5, 8])
def test_pad_to_multiple_of_pads_prompt_batches_with_the_same_completions(tmp_path, tokenizer, multiple):
    model = build_llama(tokenizer)
    calls = spy_generate(model)
    unpadded_completions = evaluate_completions(model, tokenizer, tmp_path)
    plain_width = len(calls[0]["input_ids"][0])
    calls.clear()
    padded = evaluate_completions(model, tokenizer, tmp_path, pad_to_multiple_of=multiple)
    width = len(calls[0]["input_ids"][0])
    assert width % multiple == 0 and plain_width <= width < plain_width + multiple and width != plain_width
    assert padded == unpadded_completions
    rows = [{"prompt": p} for p in CHAT]  # a long shared prefix: the shared path pads prefix + padding + suffix
    config = build_generation_config(tokenizer, 6, model_generation_config=model.generation_config)
    reference = score_model(model, tokenizer, rows, RewardScorer(Recorder()), config).completion_ids
    for engine in (EagerEngine(share_prompt_prefix=True, pad_to_multiple_of=multiple),
                   EagerEngine(pad_to_multiple_of=multiple), CompiledEngine(compile=False, pad_to_multiple_of=multiple)):
        calls.clear()
        out = score_model(model, tokenizer, rows, RewardScorer(Recorder()), config, engine=engine)
        assert out.completion_ids == reference
        assert len(calls[0]["input_ids"][0]) % multiple == 0
    assert EagerEngine(share_prompt_prefix=True).can_share(model, config, {})


def test_pad_to_multiple_of_values(tmp_path):
    assert es_args(tmp_path).pad_to_multiple_of is None  # GRPO's "auto": no padding off AWS Neuron
    assert es_args(tmp_path, pad_to_multiple_of="16").pad_to_multiple_of == 16
    assert es_args(tmp_path, pad_to_multiple_of="None").pad_to_multiple_of is None
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        es_args(tmp_path, pad_to_multiple_of=0)


# ---------------------------------------------------------------------------------------------- 10. seeding
@pytest.mark.parametrize("generation_kwargs", [{"do_sample": True}, {"do_sample": True, "top_k": 5}])
def test_sampling_through_generation_kwargs_is_seeded(tmp_path, tokenizer, generation_kwargs):
    model = build_llama(tokenizer)
    first, second = evaluate_completions(model, tokenizer, tmp_path, calls=2, generation_kwargs=generation_kwargs)
    assert first == second
    assert first != evaluate_completions(model, tokenizer, tmp_path)  # it does sample
    assert first != evaluate_completions(model, tokenizer, tmp_path, generation_kwargs=generation_kwargs, seed=1)


def test_do_sample_through_generation_kwargs_trains_as_temperature_one(tmp_path, tokenizer):
    """``generation_kwargs={"do_sample": True}`` samples at GRPO's temperature 1.0, seeded per member as
    ``temperature=1.0`` is: the same rollouts, the same weights."""
    weights = []
    for kwargs in ({"temperature": 1.0}, {"generation_kwargs": {"do_sample": True}}):
        model = build_llama(tokenizer)
        args = es_args(tmp_path / str(len(weights)), max_steps=2, population_size=4, **kwargs)
        ESTrainer(model, Recorder(), args=args, train_dataset=Dataset.from_dict({"prompt": PLAIN}),
                  processing_class=tokenizer).train()
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not all(torch.equal(weights[0][k], v) for k, v in build_llama(tokenizer).state_dict().items())


def test_trl_es_eval_seeds_a_greedy_pass_that_samples(tmp_path, tiny_model_dir, monkeypatch):
    import trl_es.rollout
    from trl_es.cli import main

    seen, score = [], trl_es.rollout.score_model

    def recording(*args, **kwargs):
        out = score(*args, **kwargs)
        seen.append(out.completion_ids)
        return out

    monkeypatch.setattr(trl_es.rollout, "score_model", recording)
    runs = []
    for _ in range(2):
        seen.clear()
        main(["eval", "--model_name_or_path", tiny_model_dir, "--task", "arithmetic", "--num_eval_prompts", "3",
              "--max_new_tokens", "4", "--generation_kwargs", '{"do_sample": true}'])
        runs.append(list(seen))
    assert runs[0] == runs[1]
