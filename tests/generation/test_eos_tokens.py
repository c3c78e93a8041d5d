"""The model's end-of-turn ids end completions in every engine (issue 32, class 1).

A model whose ``generation_config.eos_token_id`` holds ids the tokenizer does not call ``eos_token`` (Gemma-3-it's
``<end_of_turn>``, Phi-3.5's ``<|end|>``) stops there in ``model.generate``; every trl_es path must cut its
completions there too, as TRL's GRPOTrainer does (the tokenizer's EOS and the model's ids). The models here are tiny
Llamas whose greedy next token depends on the last token only (attention and MLP outputs zeroed, one embedding
direction per scripted token): after a prompt's final ``"\\n"`` they write ``"yes" <stop> " no no no ..."``.
"""

import pytest
import torch
from datasets import Dataset
from conftest import needs_inductor_vectorized_cpu
from tiny import build_llama, build_tokenizer

from trl_es import ESConfig, ESTrainer
from trl_es.analysis import evaluate_policy, off_task_kl
from trl_es.generation import CompiledEngine, EagerEngine, eos_token_ids, generate_completions, stop_token_ids
from trl_es.generation.vllm_engine import sampling_kwargs, with_model_defaults
from trl_es.rollout import RewardScorer, build_generation_config, prompt_texts

EOT = "<end_of_turn>"
SCALE = 6.0
"""lm_head weight of a scripted transition: a logit of 6 * sqrt(hidden) = 34 against 0 (sampling at T = 1 draws it
too, with probability 1 - 1e-13)."""


def end_of_turn_tokenizer():
    """The tests' character-level ChatML tokenizer with a Gemma-style ``<end_of_turn>`` special token added (its
    ``eos_token`` stays ``<|im_end|>``)."""
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([EOT], special_tokens=True)
    return tokenizer


@pytest.fixture(scope="module")
def eos_tokenizer():
    return end_of_turn_tokenizer()


def ids_of(tokenizer, *tokens):
    return [tokenizer.convert_tokens_to_ids(t) for t in tokens]


# The three inputs of the class: (the model's generation_config.eos_token_id, the token the model ends its turn on)
CASES = {
    # Gemma-3-it / Llama-3 style: a list holding the tokenizer's EOS and an end-of-turn id
    "list-with-end-of-turn": (("<|im_end|>", EOT), EOT),
    # one id, not the tokenizer's
    "int-end-of-turn": (EOT, EOT),
    # a list without the tokenizer's EOS; the turn ends on its second id
    "list-without-tokenizer-eos": ((EOT, "<|im_start|>"), "<|im_start|>"),
}


def scripted_llama(tokenizer, model_eos, stop: str, build=build_llama):
    """A tiny Llama whose greedy completion after a final ``"\\n"`` is ``"yes" + stop + " no no no ..."``, with
    ``generation_config.eos_token_id`` set to ``model_eos`` (a token or a tuple of tokens); ``build(tokenizer)``
    makes the (untied) model."""
    model = build(tokenizer)
    script = ["\n", "y", "e", "s", stop, " ", "n", "o"]
    transitions = dict(zip(ids_of(tokenizer, *script), ids_of(tokenizer, *script[1:], " "), strict=True))
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream is the last token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for k, (source, target) in enumerate(transitions.items()):
            model.model.embed_tokens.weight[source, k] = 1.0
            model.lm_head.weight[target, k] = SCALE
    eos = ids_of(tokenizer, *model_eos) if isinstance(model_eos, tuple) else ids_of(tokenizer, model_eos)[0]
    model.generation_config.eos_token_id = eos
    return model.eval()


def chat_rows(n=3):
    return [{"prompt": [{"role": "user", "content": f"Say yes {i}"}]} for i in range(n)]


def stops_of(tokenizer, model):
    """The ids a completion ends at, written out: the tokenizer's EOS and the model's generation_config ids."""
    declared = model.generation_config.eos_token_id
    return {tokenizer.eos_token_id, *([declared] if isinstance(declared, int) else declared)}


def reference(model, tokenizer, texts, max_new_tokens):
    """``model.generate`` with the model's own generation_config, each row cut after its first stop id; and the
    generated width (``generate`` stopped there)."""
    inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    stops, rows = stops_of(tokenizer, model), []
    for row in out[:, inputs["input_ids"].shape[1] :].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in stops), len(row))
        rows.append(row[:end])
    return rows, out.shape[1] - inputs["input_ids"].shape[1]


def expected_ids(tokenizer, stop):
    return ids_of(tokenizer, "y", "e", "s", stop)


class Recorder:
    """A TRL reward function that keeps what it is handed."""

    __name__ = "recorder"

    def __init__(self):
        self.completions, self.completion_ids = [], []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        self.completions += texts
        self.completion_ids += [list(ids) for ids in completion_ids]
        return [float(len(text)) for text in texts]


# ---------------------------------------------------------------------------------------------- the settings
def test_eos_ids_are_the_tokenizers_and_the_models(eos_tokenizer):
    im_end, eot, im_start = ids_of(eos_tokenizer, "<|im_end|>", EOT, "<|im_start|>")
    expected = {"list-with-end-of-turn": [im_end, eot], "int-end-of-turn": [im_end, eot],
                "list-without-tokenizer-eos": [im_end, eot, im_start]}
    for case, (model_eos, stop) in CASES.items():
        model = scripted_llama(eos_tokenizer, model_eos, stop)
        assert eos_token_ids(eos_tokenizer, model.generation_config) == expected[case], case
        for temperature in (0.0, 1.0):
            config = build_generation_config(eos_tokenizer, 8, temperature,
                                             model_generation_config=model.generation_config)
            assert config.eos_token_id == expected[case] and config.pad_token_id == eos_tokenizer.pad_token_id
            assert stop_token_ids(config, model, eos_tokenizer) == expected[case]
    assert eos_token_ids(eos_tokenizer) == [im_end]  # no model config: the tokenizer's only


def test_a_model_with_the_tokenizers_eos_gets_the_same_config_as_before(eos_tokenizer):
    """The tiny models' generation_config holds the tokenizer's EOS only: the config is the one built without the
    model (an int EOS), so every recorded result stays as it was."""
    model = build_llama(eos_tokenizer)
    for temperature in (0.0, 0.6):
        with_model = build_generation_config(eos_tokenizer, 8, temperature, 0.9,
                                             model_generation_config=model.generation_config)
        assert with_model.to_dict() == build_generation_config(eos_tokenizer, 8, temperature, 0.9).to_dict()
        assert with_model.eos_token_id == eos_tokenizer.eos_token_id


def test_explicit_eos_in_generation_kwargs_wins(eos_tokenizer):
    model = scripted_llama(eos_tokenizer, ("<|im_end|>", EOT), EOT)
    config = build_generation_config(eos_tokenizer, 9, generation_kwargs={"eos_token_id": eos_tokenizer.eos_token_id},
                                     model_generation_config=model.generation_config)
    assert config.eos_token_id == eos_tokenizer.eos_token_id
    texts, ids = generate_completions(model, eos_tokenizer, prompt_texts(chat_rows(2), eos_tokenizer), config)
    assert ids == [ids_of(eos_tokenizer, "y", "e", "s", EOT, " ", "n", "o", " ", "n")] * 2  # never stopped
    assert texts == ["yes no n"] * 2


def test_the_tokenizers_eos_still_ends_a_completion(eos_tokenizer):
    """The union, as TRL: a model declaring only ``<end_of_turn>`` still stops at the tokenizer's ``<|im_end|>``."""
    model = scripted_llama(eos_tokenizer, EOT, "<|im_end|>")
    config = build_generation_config(eos_tokenizer, 8, model_generation_config=model.generation_config)
    texts, ids = generate_completions(model, eos_tokenizer, prompt_texts(chat_rows(2), eos_tokenizer), config)
    assert ids == [expected_ids(eos_tokenizer, "<|im_end|>")] * 2 and texts == ["yes"] * 2


def test_pad_falls_back_to_the_models_then_the_first_eos():
    tokenizer = build_tokenizer()
    model = build_llama(tokenizer)
    tokenizer.pad_token = None
    assert build_generation_config(tokenizer, 4, model_generation_config=model.generation_config).pad_token_id == 0
    assert build_generation_config(tokenizer, 4).pad_token_id == tokenizer.eos_token_id


# ---------------------------------------------------------------------------------------------- the engines
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("engine", ["eager", "eager-shared-prefix", "static-cache"])
def test_engines_stop_where_generate_stops(eos_tokenizer, case, engine):
    model_eos, stop = CASES[case]
    model = scripted_llama(eos_tokenizer, model_eos, stop)
    texts = prompt_texts(chat_rows(), eos_tokenizer)
    expected, width = reference(model, eos_tokenizer, texts, 8)
    assert expected == [expected_ids(eos_tokenizer, stop)] * 3 and width == 4  # generate stopped at the stop id
    config = build_generation_config(eos_tokenizer, 8, model_generation_config=model.generation_config)
    engines = {"eager": EagerEngine(), "eager-shared-prefix": EagerEngine(share_prompt_prefix=True),
               "static-cache": CompiledEngine(compile=False)}
    out = generate_completions(model, eos_tokenizer, texts, config, num_generations=2, engine=engines[engine])
    assert out.ids == [ids for ids in expected for _ in range(2)]
    assert out.texts == ["yes"] * 6


@needs_inductor_vectorized_cpu
def test_compiled_engine_stops_at_the_end_of_turn_on_cpu(eos_tokenizer):
    """torch.compile'd decoding steps (inductor on the CPU)."""
    model = scripted_llama(eos_tokenizer, ("<|im_end|>", EOT), EOT)
    texts = prompt_texts(chat_rows(), eos_tokenizer)
    config = build_generation_config(eos_tokenizer, 8, model_generation_config=model.generation_config)
    out = generate_completions(model, eos_tokenizer, texts, config, engine=CompiledEngine(compile=True))
    assert out.ids == reference(model, eos_tokenizer, texts, 8)[0] == [expected_ids(eos_tokenizer, EOT)] * 3
    assert out.texts == ["yes"] * 3


# ---------------------------------------------------------------------------------------------- the trainer
def es_args(tmp_path, **kwargs):
    return ESConfig(output_dir=str(tmp_path), max_steps=1, population_size=4, prompt_batch_size=2,
                    max_completion_length=8, sigma=0.02, learning_rate=0.02, report_to=[], save_strategy="no",
                    noise_table_size=1 << 20, disable_tqdm=True, seed=0, **kwargs)


@pytest.mark.parametrize("case", ["list-with-end-of-turn", "list-without-tokenizer-eos"])
@pytest.mark.parametrize("backend", [{}, {"population_backend": "batched_lowrank", "noise_rank": 2}],
                         ids=["sequential", "batched_lowrank"])
def test_training_members_and_evaluate_hand_the_reward_the_cut_completion(eos_tokenizer, tmp_path, case, backend):
    """What the reward sees in every member's rollout (full-rank members one by one, low-rank members as batched
    rows) and in ``ESTrainer.evaluate()``: generate's completion, cut after the model's stop id."""
    model_eos, stop = CASES[case]
    model = scripted_llama(eos_tokenizer, model_eos, stop)
    rows = chat_rows(4)
    expected = reference(model, eos_tokenizer, prompt_texts(rows, eos_tokenizer), 8)[0]
    assert expected == [expected_ids(eos_tokenizer, stop)] * 4
    reward = Recorder()
    trainer = ESTrainer(model, reward, args=es_args(tmp_path, **backend), train_dataset=Dataset.from_list(rows),
                        eval_dataset=Dataset.from_list(rows), processing_class=eos_tokenizer)
    assert trainer.generation_config.eos_token_id == eos_token_ids(eos_tokenizer, model.generation_config)
    trainer.train()
    seen = len(reward.completions)
    assert seen == 4 * 2  # four members, two prompts each
    assert reward.completions == ["yes"] * seen
    assert reward.completion_ids == [expected_ids(eos_tokenizer, stop)] * seen
    reward.completions, reward.completion_ids = [], []
    metrics = trainer.evaluate()
    assert reward.completions == ["yes"] * 4 and reward.completion_ids == expected
    assert metrics["eval_reward"] == 3.0


# ---------------------------------------------------------------------------------------------- the evaluations
@pytest.mark.parametrize("case", ["list-with-end-of-turn", "int-end-of-turn"])
def test_greedy_and_sampled_evaluation_stop_at_the_end_of_turn(eos_tokenizer, case):
    """``evaluate_policy``: greedy accuracy and the sampled pass (``sample_policy``, CandidateSampler draws)."""
    model_eos, stop = CASES[case]
    model = scripted_llama(eos_tokenizer, model_eos, stop)
    rows = chat_rows(3)
    reward = Recorder()
    report = evaluate_policy(model, eos_tokenizer, rows, [reward], max_new_tokens=8, num_samples=2, pass_k=(1, 2),
                             progress=False)
    assert len(reward.completions) == 3 + 3 * 2  # greedy, then two samples per prompt
    assert reward.completions == ["yes"] * 9
    assert reward.completion_ids == [expected_ids(eos_tokenizer, stop)] * 9
    assert report["token_entropy_tokens"] == 6 * 4  # entropy counts the tokens up to the stop id, included


def test_trl_es_eval_stops_at_the_end_of_turn(eos_tokenizer, tmp_path, monkeypatch):
    """``trl-es eval`` on a saved model whose generation_config.json lists ``<end_of_turn>``."""
    from trl_es.cli import main

    model = scripted_llama(eos_tokenizer, ("<|im_end|>", EOT), EOT)
    model.save_pretrained(tmp_path)
    eos_tokenizer.save_pretrained(tmp_path)
    handed = []
    score = RewardScorer.score

    def recording_score(self, rows, completions, completion_ids, **extra):
        handed.extend(zip([c[0]["content"] for c in completions], map(list, completion_ids), strict=True))
        return score(self, rows, completions, completion_ids, **extra)

    monkeypatch.setattr(RewardScorer, "score", recording_score)
    main(["eval", "--model_name_or_path", str(tmp_path), "--num_train_prompts", "1", "--num_validation_prompts", "0",
          "--num_eval_prompts", "2", "--max_new_tokens", "8", "--num_samples", "2", "--pass_k", "1", "2",
          "--output_file", str(tmp_path / "metrics.json")])
    assert handed == [("yes", expected_ids(eos_tokenizer, EOT))] * (2 + 2 * 2)


def test_off_task_kl_counts_tokens_up_to_the_end_of_turn(eos_tokenizer):
    model = scripted_llama(eos_tokenizer, EOT, EOT)
    texts = prompt_texts(chat_rows(2), eos_tokenizer)
    out = off_task_kl(model, model, eos_tokenizer, texts, max_new_tokens=8, num_samples=2)
    assert out["kl"] == 0.0 and out["num_tokens"] == 2 * 2 * 4  # "yes" + <end_of_turn> per sample


# ---------------------------------------------------------------------------------------------- vLLM's settings
def test_vllm_sampling_arguments_stop_at_every_eos_id(eos_tokenizer):
    """The mapping to ``vllm.SamplingParams`` (no vLLM needed): every id of the config's EOS list is a stop id;
    vLLM's own stop at the tokenizer's EOS is turned off only where the config leaves that id out."""
    model = scripted_llama(eos_tokenizer, ("<|im_end|>", EOT), EOT)
    im_end, eot = ids_of(eos_tokenizer, "<|im_end|>", EOT)
    for temperature in (0.0, 1.0):
        config = build_generation_config(eos_tokenizer, 8, temperature, model_generation_config=model.generation_config)
        rows = sampling_kwargs(config, 3, eos_tokenizer.eos_token_id)
        assert len(rows) == 3
        assert all(r["stop_token_ids"] == [im_end, eot] and r["ignore_eos"] is False for r in rows)
        assert all(r["temperature"] == temperature and r["max_tokens"] == 8 for r in rows)
    only_eot = build_generation_config(eos_tokenizer, 8, generation_kwargs={"eos_token_id": eot})
    assert sampling_kwargs(only_eot, 1, im_end)[0]["stop_token_ids"] == [eot]
    assert sampling_kwargs(only_eot, 1, im_end)[0]["ignore_eos"] is True
    # the tiny models' default: the tokenizer's EOS alone, as before
    plain = sampling_kwargs(build_generation_config(eos_tokenizer, 8), 1, im_end)[0]
    assert plain["stop_token_ids"] == [im_end] and plain["ignore_eos"] is False


def test_vllm_takes_the_settings_generate_fills_from_the_model(eos_tokenizer):
    """transformers' generate fills unset settings from the model's generation_config (e.g. a min-p, or the EOS list
    when the config leaves it unset); the vLLM engine is given the same. The repetition penalty is explicit (1.0, as
    GRPO sets it; issue 42), so the model's own does not apply in either."""
    model = scripted_llama(eos_tokenizer, ("<|im_end|>", EOT), EOT)
    model.generation_config.repetition_penalty = 1.3
    model.generation_config.min_p = 0.05
    config = build_generation_config(eos_tokenizer, 8, generation_kwargs={"eos_token_id": None})
    filled = with_model_defaults(config, model.generation_config)
    assert filled.min_p == 0.05 and filled.eos_token_id == ids_of(eos_tokenizer, "<|im_end|>", EOT)
    assert config.min_p is None and config.eos_token_id is None  # the input is unchanged
    assert filled.repetition_penalty == config.repetition_penalty == 1.0
    assert sampling_kwargs(filled, 1, eos_tokenizer.eos_token_id)[0]["repetition_penalty"] == 1.0
    explicit = build_generation_config(eos_tokenizer, 8, generation_kwargs={"repetition_penalty": 1.1})
    assert with_model_defaults(explicit, model.generation_config).repetition_penalty == 1.1  # the user's wins


def test_hyper_es_scores_the_cut_completion(eos_tokenizer, tmp_path):
    """Hyper-ES's rollouts (here its evaluation of the base and of a merge): the same generation settings."""
    from peft import LoraConfig, get_peft_model

    from trl_es import HyperESConfig, HyperESTrainer

    model = scripted_llama(eos_tokenizer, ("<|im_end|>", EOT), EOT)
    adapters = []
    for k in range(2):  # small deltas: the merged model writes the same script
        torch.manual_seed(k)
        peft_model = get_peft_model(build_llama(eos_tokenizer), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 1e-3)
        peft_model.save_pretrained(tmp_path / f"adapter_{k}")
        adapters.append(str(tmp_path / f"adapter_{k}"))
    reward = Recorder()
    rows = Dataset.from_list(chat_rows(2))
    args = HyperESConfig(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, max_generations=1,
                         population_size=2, prompt_batch_size=2, max_completion_length=8, save_strategy="no",
                         disable_tqdm=True, seed=0)
    trainer = HyperESTrainer(model, adapters, reward_funcs=reward, args=args, train_dataset=rows, eval_dataset=rows,
                             processing_class=eos_tokenizer)
    assert trainer.evaluate(genome="base")["eval_reward"] == 3.0
    assert trainer.evaluate(genome=0)["eval_reward"] == 3.0
    assert reward.completions == ["yes"] * 4 and reward.completion_ids == [expected_ids(eos_tokenizer, EOT)] * 4
