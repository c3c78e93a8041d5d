"""TRL's own GRPOTrainer tests, ported to ESTrainer: every case of ``tests/test_grpo_trainer.py`` (huggingface/trl
main) that concerns what a user brings along (datasets, eval sets, reward functions and models, models and PEFT,
generation settings, logging options, tools, environments and rollout_func) runs here against ``ESTrainer`` under the
TRL test's own name; every other case is listed in :data:`NOT_PORTED` with the reason ES does not port it
(:func:`test_every_trl_case_is_ported_or_listed` checks that the two together cover every TRL test name,
:data:`TRL_TEST_NAMES`).

How the TRL tests translate:

* No hub: TRL's ``trl-internal-testing/*`` models are built here at tiny sizes and saved to a folder, which the tests
  pass as the model "id" (a path string), as TRL passes the hub id. The policy tokenizer has multi-character tokens
  (as Qwen2's BPE), so that a completion's length in characters varies with its content, as it does with TRL's tiny
  models (TRL's length rewards would otherwise give every member the same fitness: an exactly zero ES step).
  ``trl-internal-testing/zen`` is :func:`zen`: the same two formats (``standard_prompt_only``,
  ``conversational_prompt_only``), a 17-row train split and a 2-row test split.
* TRL's common ``GRPOConfig(learning_rate=0.1, per_device_train_batch_size=3, num_generations=3,
  max_completion_length=8)`` is :func:`grpo_args`: ``prompt_batch_size=3`` (GRPO's ``per_device_train_batch_size=3``
  would map to its one prompt per step, ``3 / num_generations``; 3 prompts give the members more to differ on),
  ``num_generations=3`` with
  ``temperature=1.0`` (what an unset temperature resolves to with ``num_generations > 1``, GRPO's default; kept
  explicit so the cases that override ``num_generations`` still sample), a population of 4, ES's ``sigma`` /
  ``learning_rate``, and ``max_steps`` (TRL trains 3 epochs).
* TRL's "every parameter changed" assertion holds for ES too (full-rank noise moves every trained parameter when the
  members' fitness differs); where TRL expects no change, ES's step is bitwise zero.
* The agent tests (tools, environments) patch ``model.generate`` as TRL does, with scripted text instead of token ids,
  on tests/tiny.py's character-level Llama with TRL's Qwen2.5 chat template: every member then rolls out the same
  completions, so the members' fitness is equal and ES's step is bitwise zero where TRL asserts that every parameter
  changed.
"""

import asyncio
import math
import os
import re
import statistics
import string
from unittest.mock import MagicMock, patch

import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDatasetDict
from tiny import build_llama
from tiny import build_tokenizer as char_tokenizer
from tiny_tools import multiply_tool, scripted, tool_call, tool_model, tool_tokenizer, turn_of
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from trl_es import ESConfig, ESTrainer


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread is faster

SMALL_TABLE = 1 << 20
QWEN2_RM = "tiny-Qwen2ForSequenceClassification-2.5"
QWEN3_RM = "tiny-Qwen3ForSequenceClassification"

# ---------------------------------------------------------------------------------------------- TRL's test names
TRL_TEST_NAMES = (  # every `def test_...` of trl tests/test_grpo_trainer.py (all classes), extracted once
    "test_compute_entropy_mask_0", "test_compute_entropy_mask_1", "test_compute_entropy_mask_lower_threshold",
    "test_compute_entropy_threshold_0", "test_compute_entropy_threshold_1", "test_compute_entropy_all_masked",
    "test_generate_prefers_rollout_func", "test_generate_rollout_func_syncs_vllm_weights_when_needed",
    "test_generate_rollout_func_raises_when_required_keys_are_missing", "test_generation_output_has_logprobs_field",
    "test_generation_output_logprobs_accepts_floats", "test_continuous_batching_config_has_return_logprobs",
    "test_generate_batch_accepts_continuous_batching_config", "test_init_minimal", "test_train",
    "test_train_dataset_format", "test_trust_remote_code", "test_train_loss_types", "test_train_with_eval",
    "test_train_with_num_generations_eval", "test_train_with_iterable_dataset", "test_init_with_eval_dataset",
    "test_iterable_dataset_requires_dispatch_batches_false", "test_iterable_dataset_forces_num_workers_zero",
    "test_iterable_eval_keeps_map_style_train_workers", "test_evaluate_with_eval_dataset",
    "test_train_eval_on_start", "test_train_multiple_iterations", "test_train_peft_config",
    "test_liger_kernel_with_peft_lm_head_raises", "test_liger_kernel_with_peft_non_lm_head_target_allowed",
    "test_liger_kernel_with_peft_modules_to_save_lm_head_allowed",
    "test_liger_kernel_with_peft_prompt_learning_raises", "test_train_peft_model", "test_train_moe_peft_model",
    "test_train_peft_with_gradient_checkpointing", "test_train_different_reward_model",
    "test_train_reward_func_standard", "test_train_reward_func_conversational", "test_train_multiple_reward_funcs",
    "test_train_sync_and_async_reward_funcs", "test_train_multiple_reward_funcs_with_None_output",
    "test_train_multiple_reward_funcs_with_weights", "test_reward_metric_reflects_reward_weights",
    "test_train_multiple_mixed_reward_funcs", "test_train_reward_func_additional_column",
    "test_train_with_sync_ref_model", "test_train_beta_non_zero", "test_train_with_pad_to_multiple_of",
    "test_get_off_policy_mask", "test_get_off_policy_mask_padding", "test_train_with_off_policy_mask",
    "test_train_with_off_policy_mask_with_liger", "test_compute_liger_loss_passes_vllm_is_ratio",
    "test_train_with_bias_correction_kl", "test_train_with_cast_lm_head_to_fp32", "test_train_with_static_entropy",
    "test_train_with_adaptive_entropy", "test_entropy_bonus_scale",
    "test_train_with_adaptive_entropy_gradient_accumulation", "test_entropy_bonus_flows_gradients",
    "test_train_with_entropy_filter", "test_train_vllm_and_peft", "test_train_vllm_structured_outputs",
    "test_train_vllm_importance_sampling_correction", "test_train_with_additional_generation_kwargs",
    "test_train_vllm_with_additional_generation_kwargs", "test_train_normalize_then_sum_aggregation",
    "test_train_scale_rewards", "test_train_with_mask_truncated_completions",
    "test_train_with_mask_truncated_completions_all_masked", "test_warning_raised_all_rewards_none",
    "test_warning_raised_sequence_level_with_token_summed_loss", "test_train_num_generations_larger_than_batch_size",
    "test_train_delta_clipping", "test_train_multiple_dataloader_workers", "test_train_with_generation_kwargs",
    "test_train_with_reward_func_accessing_trainer_state", "test_train_reward_func_with_log_extra",
    "test_train_reward_func_with_log_metric", "test_prepare_input_called_with_correct_data",
    "test_train_sequence_importance_sampling", "test_train_with_chat_template_kwargs", "test_train_with_tools",
    "test_train_with_multiple_environments", "test_train_with_unknown_environment_raises",
    "test_train_with_environment_factory", "test_train_with_environment_owned_reward",
    "test_environment_owned_reward_coexists_with_reward_funcs", "test_environment_owned_reward_mixed_environments",
    "test_no_reward_source_raises", "test_dataset_required_without_environment",
    "test_environment_owned_data_requires_max_steps", "test_multiple_environments_without_dataset_raises",
    "test_train_with_environment_owned_data", "test_train_with_malformed_tool_calls",
    "test_mismatched_reward_processing_classes_length", "test_correct_reward_processing_classes_list",
    "test_single_reward_model_with_single_processing_class", "test_train_vlm",
    "test_train_vlm_with_pad_to_multiple_of", "test_train_vlm_beta_non_zero", "test_train_vlm_peft",
    "test_train_vlm_and_importance_sampling", "test_train_vlm_and_liger", "test_train_vlm_and_vllm",
    "test_train_vlm_multi_image", "test_train_vlm_log_multimodal_false", "test_train_with_tools_multimodal_response",
    "test_train_with_liger_grpo_kernel", "test_train_with_liger_grpo_kernel_and_peft",
    "test_liger_grpo_kernel_importance_sampling", "test_train_with_transformers_continuous_batching",
    "test_vlm_training", "test_vlm_processor_vllm_colocate_mode", "test_train_vllm",
)

_ENTROPY_MASK = ("TestGetHighEntropyMask (GRPOTrainer.get_high_entropy_mask): ES computes no token entropies; its "
                 "exploration is sigma (and sampling).")
_CB_CONTRACT = ("TestTransformersContinuousBatchingContract (transformers' continuous batching returning GRPO's "
                "logprobs): ES needs no log-probabilities; its continuous-batching engine reads generated_tokens only "
                "(use_transformers_continuous_batching: test_train_with_transformers_continuous_batching).")
_LIGER = "Liger's fused GRPO loss: ES computes no loss (use_liger_kernel has nothing to fuse)."
_ENTROPY = "Entropy regularization / filtering of the GRPO loss: ES computes no loss and no token entropies."
_OFF_POLICY = "Off-policy masking of the GRPO loss (KL to the generation policy): ES keeps no old policy and no KL."
_VLM = "Vision-language models (images in the prompts): not supported by ESTrainer yet."

NOT_PORTED = {
    # helper classes at the top of the TRL file
    "test_compute_entropy_mask_0": _ENTROPY_MASK,
    "test_compute_entropy_mask_1": _ENTROPY_MASK,
    "test_compute_entropy_mask_lower_threshold": _ENTROPY_MASK,
    "test_compute_entropy_threshold_0": _ENTROPY_MASK,
    "test_compute_entropy_threshold_1": _ENTROPY_MASK,
    "test_compute_entropy_all_masked": _ENTROPY_MASK,
    "test_generate_rollout_func_syncs_vllm_weights_when_needed": "TestGRPORolloutDispatch (GRPO's _generate syncing "
                                                                 "the vLLM weights before rollout_func runs, mocked): "
                                                                 "ESTrainer has no _generate and no pending sync (the "
                                                                 "engine gets every update as it is told); "
                                                                 "rollout_func through trainer.vllm_generation is "
                                                                 "tested in tests/generation/test_vllm.py.",
    "test_generation_output_has_logprobs_field": _CB_CONTRACT,
    "test_generation_output_logprobs_accepts_floats": _CB_CONTRACT,
    "test_continuous_batching_config_has_return_logprobs": _CB_CONTRACT,
    "test_generate_batch_accepts_continuous_batching_config": _CB_CONTRACT,
    # TestGRPOTrainer
    "test_train_loss_types": "loss_type (bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo): ES computes no loss; "
                             "ESConfig accepts loss_type with a warning (no effect; counterpart: es_optimizer and "
                             "fitness_shaping).",
    "test_train_multiple_iterations": "num_iterations=2 (several optimizer passes over one generation batch): ES "
                                      "scores each prompt batch once and steps once; another value than 1 is "
                                      "accepted with a warning (no effect).",
    "test_liger_kernel_with_peft_lm_head_raises": _LIGER,
    "test_liger_kernel_with_peft_non_lm_head_target_allowed": _LIGER,
    "test_liger_kernel_with_peft_modules_to_save_lm_head_allowed": _LIGER,
    "test_liger_kernel_with_peft_prompt_learning_raises": _LIGER,
    "test_train_with_sync_ref_model": "sync_ref_model / beta: ES has no reference model and no KL term (counterpart: "
                                      "awd_lambda).",
    "test_train_beta_non_zero": "beta > 0 (KL to a reference model): ES has no KL term; ESConfig accepts it with a "
                                "warning (no effect; counterpart: awd_lambda).",
    "test_get_off_policy_mask": _OFF_POLICY,
    "test_get_off_policy_mask_padding": _OFF_POLICY,
    "test_train_with_off_policy_mask": _OFF_POLICY,
    "test_train_with_off_policy_mask_with_liger": _OFF_POLICY + " " + _LIGER,
    "test_compute_liger_loss_passes_vllm_is_ratio": _LIGER + " No vLLM importance ratio either.",
    "test_train_with_bias_correction_kl": "use_bias_correction_kl: ES has no KL term.",
    "test_train_with_cast_lm_head_to_fp32": "cast_lm_head_to_fp32 (a float32 LM head for the loss's log-probs): ES "
                                            "computes no log-probs; not supported (refused; load the model in "
                                            "float32).",
    "test_train_with_static_entropy": _ENTROPY,
    "test_train_with_adaptive_entropy": _ENTROPY,
    "test_entropy_bonus_scale": _ENTROPY,
    "test_train_with_adaptive_entropy_gradient_accumulation": _ENTROPY,
    "test_entropy_bonus_flows_gradients": _ENTROPY,
    "test_train_with_entropy_filter": _ENTROPY,
    "test_train_vllm_and_peft": "vLLM server mode (GPU) with PEFT: ES's vLLM engine is colocated only (server mode not "
                                "supported yet) and use_vllm with a PEFT model is refused (not supported yet).",
    "test_train_vllm_structured_outputs": "vllm_structured_outputs_regex on a vLLM server (GPU): not supported by ES "
                                          "yet (refused by name).",
    "test_train_vllm_importance_sampling_correction": "vLLM importance-sampling correction: ES scores exactly the "
                                                      "completions its engine generated; nothing off-policy to "
                                                      "correct.",
    "test_train_vllm_with_additional_generation_kwargs": "vLLM server mode (GPU, skipped in TRL too): not supported "
                                                         "by ES yet; the same generation settings are ported with "
                                                         "the transformers engine (test_train_with_additional_"
                                                         "generation_kwargs).",
    "test_train_normalize_then_sum_aggregation": "multi_objective_aggregation='normalize_then_sum': ES sums the "
                                                 "weighted rewards, then shapes the members' fitness; normalizing "
                                                 "each reward first is not supported yet (refused by name).",
    "test_train_scale_rewards": "scale_rewards (GRPO's advantage normalization): ES has no advantages; its "
                                "counterpart is fitness_shaping / per_prompt_shaping.",
    "test_warning_raised_sequence_level_with_token_summed_loss": "importance_sampling_level x loss_type: ES has "
                                                                 "neither.",
    "test_train_delta_clipping": "delta (two-sided clipping of the importance ratio): ES has no ratio.",
    "test_train_sequence_importance_sampling": "importance_sampling_level='sequence': ES has no importance ratio.",
    # TestGRPOTrainerVLM
    "test_train_vlm": _VLM,
    "test_train_vlm_with_pad_to_multiple_of": _VLM,
    "test_train_vlm_beta_non_zero": _VLM,
    "test_train_vlm_peft": _VLM,
    "test_train_vlm_and_importance_sampling": _VLM,
    "test_train_vlm_and_liger": _VLM,
    "test_train_vlm_and_vllm": _VLM,
    "test_train_vlm_multi_image": _VLM,
    "test_train_vlm_log_multimodal_false": _VLM,
    "test_train_with_tools_multimodal_response": _VLM,
    # TestGRPOTrainerSlow (GPU)
    "test_train_with_liger_grpo_kernel": _LIGER + " (GPU test.)",
    "test_train_with_liger_grpo_kernel_and_peft": _LIGER + " (GPU test.)",
    "test_liger_grpo_kernel_importance_sampling": _LIGER + " (GPU test.)",
    "test_vlm_training": _VLM + " (GPU test.)",
    "test_vlm_processor_vllm_colocate_mode": _VLM + " (GPU, vLLM.)",
    "test_train_vllm": "GPU + vLLM + Qwen2.5-0.5B from the hub: ES's colocated vLLM engine is tested in "
                       "tests/generation/test_vllm.py on GPU machines.",
}


def test_every_trl_case_is_ported_or_listed():
    """Every TRL test name is a test of this module or a key of NOT_PORTED, never both, and NOT_PORTED names only
    TRL tests."""
    assert len(TRL_TEST_NAMES) == len(set(TRL_TEST_NAMES)) == 116
    module = globals()
    ported = {name for name in TRL_TEST_NAMES if callable(module.get(name))}
    listed = set(NOT_PORTED)
    assert not ported & listed, f"both ported and listed as not ported: {sorted(ported & listed)}"
    missing = [name for name in TRL_TEST_NAMES if name not in ported and name not in listed]
    assert missing == [], f"TRL tests neither ported nor listed in NOT_PORTED: {missing}"
    assert sorted(listed - set(TRL_TEST_NAMES)) == []
    assert all(reason.strip() for reason in NOT_PORTED.values())
    for name in ported:  # each port names its TRL test first thing in its docstring
        assert re.match(rf"TRL: TestGRPOTrainer(Slow)?\.{name}[. ]", module[name].__doc__ or ""), name
    assert len(ported) == 59 and len(listed) == 57


# ---------------------------------------------------------------------------------------------- tiny stand-ins
SPECIALS = ("<pad>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN3_TEMPLATE = CHATML.replace(  # Qwen3's switch: enable_thinking=False pre-fills an empty think block
    "{{ '<|im_start|>assistant\n' }}",
    "{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}",
)
MULTI_CHAR = ("better", "never", "should", "than", "the", "is", "th", "he", "in", "er", "an", "re", "on", "at", "en",
              "es", "or", "ou", "it", "al")


def build_tokenizer(specials=SPECIALS, template=CHATML, pad="<pad>", eos="<|im_end|>", bos="<|im_start|>",
                    reverse=False) -> PreTrainedTokenizerFast:
    """Printable characters plus a few multi-character tokens (as a BPE vocabulary has), ``specials`` first."""
    chars = [c for c in string.printable if c not in "\x0b\x0c"]
    tokens = chars + list(MULTI_CHAR)
    vocab = {tok: i for i, tok in enumerate(list(specials) + (tokens[::-1] if reverse else tokens))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials[0]))
    pattern = "|".join(re.escape(m) for m in sorted(MULTI_CHAR, key=len, reverse=True)) + r"|[\s\S]"
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, eos_token=eos, bos_token=bos)
    fast.chat_template = template
    return fast


SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512)
ARCHITECTURES = {  # TRL's test_train model ids -> (config, causal LM class, the tiny sizes they need)
    "trl-internal-testing/tiny-Cohere2ForCausalLM": ("Cohere2Config", "Cohere2ForCausalLM", {}),
    "trl-internal-testing/tiny-Glm4MoeForCausalLM": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        head_dim=8, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1)),
    "trl-internal-testing/tiny-GptOssForCausalLM": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "trl-internal-testing/tiny-Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)),
    "trl-internal-testing/tiny-NemotronHForCausalLM-nano": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        num_hidden_layers=None, head_dim=8, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=8, n_groups=1,
        chunk_size=16, n_routed_experts=4, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16)),
    "trl-internal-testing/tiny-Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8)),
}


def tiny_model(model_id, tokenizer, seed=0):
    """The tiny stand-in of TRL's ``model_id`` (a causal LM), in float32."""
    import transformers

    config_name, model_name, extra = ARCHITECTURES[model_id]
    kwargs = {**SIZES, **extra}
    if kwargs["num_hidden_layers"] is None:  # NemotronH: the layer pattern (mamba, moe, attention, mlp) sets it
        del kwargs["num_hidden_layers"]
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, **kwargs)
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).float()


def hub_reward_model(tokenizer, config_name="Qwen2Config", model_name="Qwen2ForSequenceClassification", seed=1):
    """A tiny sequence-classification reward model (one label) for ``tokenizer``."""
    import transformers

    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer), num_labels=1, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, **{**SIZES, "num_hidden_layers": 1},
        **({"head_dim": 8} if config_name == "Qwen3Config" else {}))
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).float()


def save(model, tokenizer, path) -> str:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def policy_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, policy_tokenizer):
    """trl-internal-testing/tiny-Qwen2ForCausalLM-2.5, as a local folder."""
    path = tmp_path_factory.mktemp("models") / "tiny-Qwen2ForCausalLM-2.5"
    return save(tiny_model("trl-internal-testing/tiny-Qwen2ForCausalLM-2.5", policy_tokenizer), policy_tokenizer, path)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, policy_tokenizer):
    """trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5 (same tokenizer as the policy), as a folder."""
    path = tmp_path_factory.mktemp("reward-models") / QWEN2_RM
    return save(hub_reward_model(policy_tokenizer), policy_tokenizer, path)


@pytest.fixture(scope="module")
def qwen3_reward_model_dir(tmp_path_factory):
    """trl-internal-testing/tiny-Qwen3ForSequenceClassification, with a tokenizer of its own, as a folder."""
    tokenizer = build_tokenizer(template=QWEN3_TEMPLATE, reverse=True)
    path = tmp_path_factory.mktemp("reward-models") / QWEN3_RM
    return save(hub_reward_model(tokenizer, "Qwen3Config", "Qwen3ForSequenceClassification", seed=2), tokenizer, path)


ZEN = [
    "Beautiful is better than", "Explicit is", "Simple is better", "Complex", "Flat is better than",
    "Sparse is better", "Readability", "Special cases aren't special", "Although practicality beats",
    "Errors should never", "Unless explicitly", "In the face of ambiguity, refuse", "There should be one--",
    "Although that way may not be", "Now is better than", "Although never is often better than",
    "If the implementation is hard to explain,",
    # test split
    "If the implementation is easy to explain,", "Namespaces are one honking great idea --",
]


def zen(config_name="standard_prompt_only", split=None, streaming=False):
    """``load_dataset("trl-internal-testing/zen", config_name, split=split, streaming=streaming)``, built locally:
    17 train and 2 test prompts, as text (``standard_prompt_only``) or one user message
    (``conversational_prompt_only``)."""
    def part(prompts):
        if config_name == "conversational_prompt_only":
            prompts = [[{"role": "user", "content": p}] for p in prompts]
        data = Dataset.from_dict({"prompt": prompts})
        return data.to_iterable_dataset() if streaming else data

    splits = {"train": part(ZEN[:17]), "test": part(ZEN[17:])}
    if split is not None:
        return splits[split]
    return IterableDatasetDict(splits) if streaming else DatasetDict(splits)


def grpo_args(tmp_path, **kwargs):
    """TRL's common test GRPOConfig in ES terms (module docstring)."""
    defaults = dict(output_dir=str(tmp_path / "out"), prompt_batch_size=3,
                    num_generations=3, temperature=1.0, max_completion_length=8, population_size=4, sigma=0.02,
                    learning_rate=0.02, max_steps=1, noise_table_size=SMALL_TABLE, report_to="none",
                    save_strategy="no", disable_tqdm=True, seed=0)
    defaults.update(kwargs)
    return ESConfig(**defaults)


def init_args(tmp_path, **kwargs):
    """TRL's ``GRPOConfig(output_dir=..., report_to="none")`` of its construction-only tests."""
    return ESConfig(output_dir=str(tmp_path / "out"), report_to="none", **kwargs)


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_all_changed(previous, model):
    for n, param in previous.items():
        assert not torch.equal(param, model.get_parameter(n)), f"Parameter {n} has not changed."


def assert_unchanged(previous, model):
    for n, param in previous.items():
        assert torch.equal(param, model.get_parameter(n)), f"Parameter {n} has changed."


def step_logs(trainer):
    """The training iterations' log entries."""
    return [h for h in trainer.state.log_history if "num_nan_members" in h]


def assert_trained(trainer, previous, reward_names, num_completions=4 * 3 * 3):
    """TRL's checks (train_loss logged, every parameter changed) and GRPO's metric keys with values that hold for
    any rewards: ``num_completions`` completions per iteration (population x prompts x generations)."""
    assert trainer.state.log_history[-1]["train_loss"] is not None
    logs = step_logs(trainer)
    assert len(logs) == trainer.state.global_step == trainer.args.max_steps
    for log in logs:
        for name in reward_names:
            assert f"rewards/{name}/mean" in log and f"rewards/{name}/std" in log, name
        for key in ("reward", "reward_std", "frac_reward_zero_std", "num_tokens", "completions/mean_length",
                    "completions/clipped_ratio", "fitness/mean", "fitness/std"):
            assert key in log, key
        assert log["num_nan_members"] == 0 and log["num_invalid_rewards"] == 0
        assert log["loss"] == pytest.approx(-log["fitness/mean"])
        assert log["completions/mean_length"] == pytest.approx(log["completion_tokens"] / num_completions)
        assert 1 <= log["completions/min_length"] <= log["completions/max_length"] <= trainer.args.max_completion_length
        assert log["reward_min"] <= log["fitness/mean"] <= log["reward_max"]
    assert logs[-1]["num_tokens"] == trainer.state.num_input_tokens_seen > 0
    assert_all_changed(previous, trainer.model)


class Calls:
    """Wraps a reward function (keeps its name): records each call's completions, extra keyword arguments and
    rewards."""

    def __init__(self, func):
        self.func, self.__name__ = func, func.__name__
        self.calls = []

    def __call__(self, completions, **kwargs):
        rewards = self.func(completions, **kwargs)
        self.calls.append({"completions": list(completions), "kwargs": kwargs, "rewards": list(rewards)})
        return rewards

    @property
    def rewards(self):
        return [r for call in self.calls for r in call["rewards"]]


def member_means(calls, keep=None):
    """Each member's mean reward (one call per member: the sequential population) over the completions ``keep``
    (``keep(completion_ids) -> bool``) accepts."""
    means = []
    for call in calls:
        kept = [r for r, ids in zip(call["rewards"], call["kwargs"]["completion_ids"], strict=True)
                if keep is None or keep(ids)]
        means.append(statistics.mean(kept) if kept else math.nan)
    return means


# ---------------------------------------------------------------------------------------------- models and data
def test_init_minimal(tmp_path, monkeypatch, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_init_minimal. Model, reward model (both as ids) and train_dataset only: the default
    ESConfig (output dir ``<model name>-ES`` in the working folder)."""
    monkeypatch.chdir(tmp_path)
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir, train_dataset=zen(split="train"))
    assert isinstance(trainer.args, ESConfig) and trainer.args.output_dir == "tiny-Qwen2ForCausalLM-2.5-ES"
    assert trainer.reward_func_names == [QWEN2_RM]


@pytest.mark.parametrize("model_id", [
    "trl-internal-testing/tiny-Cohere2ForCausalLM",
    "trl-internal-testing/tiny-Glm4MoeForCausalLM",
    "trl-internal-testing/tiny-GptOssForCausalLM",
    "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5",
    "trl-internal-testing/tiny-Qwen3MoeForCausalLM",
    "trl-internal-testing/tiny-NemotronHForCausalLM-nano",
])
def test_train(tmp_path, model_id, policy_tokenizer, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train. Each architecture (MoE and hybrid Mamba included) trains from its id, every
    parameter moves (unrouted experts too: ES perturbs every trained tensor). TRL's aux_loss check has no ES
    counterpart (ES computes no loss)."""
    model_dir = save(tiny_model(model_id, policy_tokenizer), policy_tokenizer, tmp_path / model_id.split("/")[-1])
    trainer = ESTrainer(model=model_dir, reward_funcs=reward_model_dir, args=grpo_args(tmp_path),
                        train_dataset=zen(split="train"))
    assert type(trainer.model).__name__ == ARCHITECTURES[model_id][1]
    previous = params(trainer.model)
    trainer.train()
    assert_trained(trainer, previous, [QWEN2_RM])


@pytest.mark.parametrize("config_name", ["standard_prompt_only", "conversational_prompt_only"])
def test_train_dataset_format(tmp_path, config_name, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_dataset_format. Standard and conversational prompts, scored by a reward model
    (which reads prompt + completion through its own chat template)."""
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir, args=grpo_args(tmp_path),
                        train_dataset=zen(config_name, split="train"))
    previous = params(trainer.model)
    trainer.train()
    assert_trained(trainer, previous, [QWEN2_RM])


REMOTE_CODE = '''
from transformers import LlamaConfig, LlamaForCausalLM


class RemoteConfig(LlamaConfig):
    model_type = "remote"


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig
'''


def test_trust_remote_code(tmp_path, policy_tokenizer):
    """TRL: TestGRPOTrainer.test_trust_remote_code. A model whose class ships as code in its folder (as
    trl-internal-testing/tiny-RemoteForCausalLM, built here): refused without trust_remote_code, loaded with it."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path / "tiny-RemoteForCausalLM"
    config = LlamaConfig(vocab_size=len(policy_tokenizer), pad_token_id=policy_tokenizer.pad_token_id,
                         eos_token_id=policy_tokenizer.eos_token_id, **SIZES)
    save(LlamaForCausalLM(config), policy_tokenizer, model_dir)
    (model_dir / "modeling_remote.py").write_text(REMOTE_CODE)
    config_file = model_dir / "config.json"
    config_dict = json.loads(config_file.read_text())
    config_dict.update(model_type="remote", architectures=["RemoteForCausalLM"],
                       auto_map={"AutoConfig": "modeling_remote.RemoteConfig",
                                 "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"})
    config_file.write_text(json.dumps(config_dict))

    def reward_func(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="custom code"):
        ESTrainer(model=str(model_dir), args=init_args(tmp_path), reward_funcs=reward_func,
                  train_dataset=zen(split="train"))
    trainer = ESTrainer(model=str(model_dir), args=init_args(tmp_path, trust_remote_code=True),
                        reward_funcs=reward_func, train_dataset=zen(split="train"))
    assert type(trainer.model).__name__ == "RemoteForCausalLM"


def test_train_with_iterable_dataset(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_with_iterable_dataset. A streaming dataset with max_steps=4:
    dispatch_batches is forced to False, and the 4 iterations read the stream in order (12 of its 17 prompts)."""
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir, args=grpo_args(tmp_path, max_steps=4),
                        train_dataset=zen(split="train", streaming=True))
    assert trainer.args.accelerator_config.dispatch_batches is False
    previous = params(trainer.model)
    seen = []
    original = trainer.training_step
    with patch.object(trainer, "training_step",
                      side_effect=lambda model, inputs, *a: seen.append(inputs) or original(model, inputs, *a)):
        trainer.train()
    assert [[row["prompt"] for row in rows] for rows in seen] == [ZEN[i:i + 3] for i in range(0, 12, 3)]
    assert_trained(trainer, previous, [QWEN2_RM])


def test_iterable_dataset_requires_dispatch_batches_false(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_iterable_dataset_requires_dispatch_batches_false. Changed: max_steps=1 (ES checks
    that a stream has max_steps first) and ES's message ("dispatch_batches=True cannot dispatch an iterable
    dataset's text rows") instead of TRL's."""
    args = init_args(tmp_path, accelerator_config={"dispatch_batches": True}, max_steps=1)
    with pytest.raises(ValueError, match="dispatch_batches=True cannot dispatch an iterable dataset"):
        ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir, args=args,
                  train_dataset=zen(split="train", streaming=True))


def test_iterable_dataset_forces_num_workers_zero(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_iterable_dataset_forces_num_workers_zero. Several dataloader workers would each
    read a share of the stream's shards and interleave them: a stream with workers must be read by one (TRL forces
    0). Added: the batches of a 2-shard stream come in stream order."""
    stream = Dataset.from_dict({"prompt": ZEN[:12]}).to_iterable_dataset(num_shards=2)
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir,
                        args=init_args(tmp_path, dataloader_num_workers=2, max_steps=1, prompt_batch_size=3),
                        train_dataset=stream)
    assert trainer.args.dataloader_num_workers == 0
    batches = iter(trainer.get_train_dataloader())
    assert [[row["prompt"] for row in next(batches)] for _ in range(4)] == [ZEN[i:i + 3] for i in range(0, 12, 3)]


def test_iterable_eval_keeps_map_style_train_workers(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_iterable_eval_keeps_map_style_train_workers. A map-style train set keeps its 4
    workers when the eval set is a stream. Changed: ES's evaluate() reads the eval rows itself (no eval DataLoader,
    so TRL's get_eval_dataloader() check has no counterpart); the stream is evaluated instead (2 prompts x 3)."""
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir,
                        args=grpo_args(tmp_path, per_device_eval_batch_size=3, dataloader_num_workers=4),
                        train_dataset=zen(split="train"), eval_dataset=zen(split="test", streaming=True))
    assert trainer.args.dataloader_num_workers == 4
    assert trainer.get_train_dataloader().num_workers == 4
    metrics = trainer.evaluate()
    assert metrics["eval_num_completions"] == 2 * 3 and metrics["eval_loss"] == -metrics["eval_reward"]
    assert trainer.args.dataloader_num_workers == 4


EVAL_DATASET_TYPES = ["dataset", "iterable_dataset", "dataset_dict", "iterable_dataset_dict", "dict_of_dataset",
                      "dict_of_iterable_dataset"]


def make_eval_dataset(eval_dataset_type):
    streaming = "iterable" in eval_dataset_type
    eval_split = zen(split="test", streaming=streaming)
    if eval_dataset_type in ("dataset", "iterable_dataset"):
        return eval_split
    if eval_dataset_type in ("dataset_dict", "iterable_dataset_dict"):
        return (IterableDatasetDict if streaming else DatasetDict)({"data1": eval_split, "data2": eval_split})
    return {"data1": eval_split, "data2": eval_split}


@pytest.mark.parametrize("eval_dataset_type", [*EVAL_DATASET_TYPES, "none"])
def test_init_with_eval_dataset(tmp_path, eval_dataset_type, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_init_with_eval_dataset. Every kind of eval set (map-style or stream, alone, in a
    DatasetDict / IterableDatasetDict or a plain dict) is kept as given."""
    eval_dataset = None if eval_dataset_type == "none" else make_eval_dataset(eval_dataset_type)
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir, args=init_args(tmp_path),
                        train_dataset=zen(split="train"), eval_dataset=eval_dataset)
    if eval_dataset_type == "none":
        assert trainer.eval_dataset is None
    elif isinstance(trainer.eval_dataset, dict):
        assert set(trainer.eval_dataset.keys()) == {"data1", "data2"}
    else:
        assert trainer.eval_dataset is eval_dataset


@pytest.mark.parametrize("eval_dataset_type", EVAL_DATASET_TYPES)
def test_evaluate_with_eval_dataset(tmp_path, eval_dataset_type, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_evaluate_with_eval_dataset. evaluate() takes the eval set directly; a dict of sets
    gives ``eval_<key>_*`` metrics per set. Added: the values (evaluate() seeds its sampling, so two copies of one
    set score the same; 2 prompts x 3 generations each)."""
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir,
                        args=grpo_args(tmp_path, per_device_eval_batch_size=3), train_dataset=zen(split="train"))
    metrics = trainer.evaluate(eval_dataset=make_eval_dataset(eval_dataset_type))
    prefixes = ["eval"] if eval_dataset_type in ("dataset", "iterable_dataset") else ["eval_data1", "eval_data2"]
    for prefix in prefixes:
        assert metrics[f"{prefix}_loss"] is not None
        assert metrics[f"{prefix}_loss"] == -metrics[f"{prefix}_reward"]
        assert metrics[f"{prefix}_num_completions"] == 2 * 3
        assert metrics[f"{prefix}_rewards/{QWEN2_RM}/mean"] == pytest.approx(metrics[f"{prefix}_reward"])
    if len(prefixes) == 2:
        assert metrics["eval_data1_reward"] == metrics["eval_data2_reward"]


def test_train_with_eval(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_with_eval. eval_strategy="steps", eval_steps=2 (max_steps=2: one evaluation,
    at step 2, of the 2 test prompts x 3 generations)."""
    dataset = zen()
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir,
                        args=grpo_args(tmp_path, per_device_eval_batch_size=3, eval_strategy="steps", eval_steps=2,
                                       max_steps=2),
                        train_dataset=dataset["train"], eval_dataset=dataset["test"])
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_reward" in h]
    assert [h["step"] for h in evals] == [2]
    assert evals[0]["eval_loss"] == -evals[0]["eval_reward"]
    assert evals[0]["eval_num_completions"] == 2 * 3
    assert f"eval_rewards/{QWEN2_RM}/mean" in evals[0]


def test_train_with_num_generations_eval(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_with_num_generations_eval. num_generations_eval=1 with num_generations=3:
    evaluation scores 1 completion per prompt (2 test prompts: 2 completions)."""
    dataset = zen()
    scored = []

    def reward_func(completions, **kwargs):
        scored.append(len(completions))
        return [float(len(c)) for c in completions]

    trainer = ESTrainer(model=qwen2_dir, reward_funcs=[reward_func, reward_model_dir],
                        args=grpo_args(tmp_path, per_device_eval_batch_size=3, num_generations_eval=1,
                                       eval_strategy="steps", eval_steps=2, max_steps=2),
                        train_dataset=dataset["train"], eval_dataset=dataset["test"])
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_reward" in h]
    assert [h["step"] for h in evals] == [2] and evals[0]["eval_num_completions"] == 2
    assert scored == [9] * 4 + [9] * 4 + [2]  # 2 iterations x 4 members x (3 prompts x 3), then 2 x 1 in evaluation


def test_train_eval_on_start(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_eval_on_start. eval_on_start=True evaluates before the first step (then at
    step 2). Changed: without loss_type="grpo" (ES computes no loss; loss_type has no effect on ES)."""
    dataset = zen()
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir,
                        args=grpo_args(tmp_path, per_device_eval_batch_size=3, eval_strategy="steps", eval_steps=2,
                                       eval_on_start=True, max_steps=2),
                        train_dataset=dataset["train"], eval_dataset=dataset["test"])
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_reward" in h]
    assert [h["step"] for h in evals] == [0, 2]
    assert all(h["eval_loss"] == -h["eval_reward"] for h in evals)


# ---------------------------------------------------------------------------------------------- PEFT
def assert_adapter_trained(trainer, previous, base_param_names):
    assert trainer.state.log_history[-1]["train_loss"] is not None
    changed = 0
    for n, param in previous.items():
        new_param = trainer.model.get_parameter(n)
        if n in base_param_names:  # the base model's parameters: bitwise unchanged (TRL: assert_close)
            assert torch.equal(param, new_param), f"Parameter {n} has changed."
        elif "base_layer" not in n:  # the adapter's
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."
            changed += 1
    assert changed > 0


def test_train_peft_config(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_peft_config. peft_config=LoraConfig(): ES perturbs the adapter only."""
    from peft import LoraConfig

    model = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
    trainer = ESTrainer(model=model, reward_funcs=reward_model_dir, args=grpo_args(tmp_path),
                        train_dataset=zen(split="train"), peft_config=LoraConfig())
    previous = params(trainer.model)
    trainer.train()
    assert_adapter_trained(trainer, previous, base_param_names)


def test_train_with_transformers_continuous_batching(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainerSlow.test_train_with_transformers_continuous_batching (a GPU test there; the CPU here).
    ``use_transformers_continuous_batching=True`` generates with ``model.generate_batch``: it trains and every
    parameter moves."""
    args = grpo_args(tmp_path, use_transformers_continuous_batching=True,
                     transformers_continuous_batching_config={"use_cuda_graph": False})
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir, args=args, train_dataset=zen(split="train"))
    assert trainer.generation_engine.name == "continuous_batching"
    previous = params(trainer.model)
    trainer.train()
    assert_trained(trainer, previous, [QWEN2_RM])


def test_train_peft_model(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_peft_model. An already-wrapped PeftModel: the adapter moves, the base does
    not (ES makes no "ref" adapter)."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
    model = get_peft_model(model, LoraConfig())
    trainer = ESTrainer(model=model, reward_funcs=reward_model_dir, args=grpo_args(tmp_path),
                        train_dataset=zen(split="train"))
    assert set(trainer.model.peft_config) == {"default"}
    previous = params(trainer.model)
    trainer.train()
    assert_adapter_trained(trainer, previous, base_param_names)


def test_train_moe_peft_model(tmp_path, policy_tokenizer, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_moe_peft_model. LoRA on a MoE's expert parameters (target_parameters, GPT-OSS).
    Changed: without beta=0.1 (ES has no reference model, so no "ref" adapter either)."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("trl-internal-testing/tiny-GptOssForCausalLM", policy_tokenizer)
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
    model = get_peft_model(model, LoraConfig(target_parameters=["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]))
    trainer = ESTrainer(model=model, reward_funcs=reward_model_dir, args=grpo_args(tmp_path),
                        train_dataset=zen(split="train"), processing_class=policy_tokenizer)
    assert "ref" not in trainer.model.peft_config
    previous = params(trainer.model)
    trainer.train()
    assert_adapter_trained(trainer, previous, base_param_names)


def test_train_peft_with_gradient_checkpointing(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_peft_with_gradient_checkpointing. gradient_checkpointing=True is accepted with
    PEFT (ES runs no backward pass, so it changes nothing)."""
    from peft import LoraConfig

    model = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
    trainer = ESTrainer(model=model, reward_funcs=reward_model_dir,
                        args=grpo_args(tmp_path, gradient_checkpointing=True),
                        train_dataset=zen(split="train"), peft_config=LoraConfig())
    previous = params(trainer.model)
    trainer.train()
    assert_adapter_trained(trainer, previous, base_param_names)


# ---------------------------------------------------------------------------------------------- reward models
def test_train_different_reward_model(tmp_path, qwen2_dir):
    """TRL: TestGRPOTrainer.test_train_different_reward_model. A reward model with its own tokenizer (other vocabulary
    and chat template, a dedicated pad token) scores conversational prompt + completion through that template."""
    reward_tokenizer = build_tokenizer(
        specials=("<|finetune_right_pad_id|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>"),
        template="{{ '<|begin_of_text|>' }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] "
                 "+ '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}{% endfor %}",
        pad="<|eot_id|>", eos="<|eot_id|>", bos="<|begin_of_text|>", reverse=True)
    reward_tokenizer.pad_token = "<|finetune_right_pad_id|>"  # as TRL: not the eos, which the template uses
    reward_model = hub_reward_model(reward_tokenizer, "LlamaConfig", "LlamaForSequenceClassification")
    seen = []
    reward_model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"]),
                                           with_kwargs=True)
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model, args=grpo_args(tmp_path),
                        train_dataset=zen("conversational_prompt_only", split="train"),
                        reward_processing_classes=reward_tokenizer)
    assert trainer.reward_processing_classes == [reward_tokenizer]
    assert reward_model.config.pad_token_id == reward_tokenizer.pad_token_id
    previous = params(trainer.model)
    trainer.train()
    assert_trained(trainer, previous, ["LlamaForSequenceClassification"])
    assert len(seen) == 4 and all(ids.shape[0] == 9 for ids in seen)  # one scoring per member
    head, user = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"
    for text in reward_tokenizer.batch_decode(seen[0]):
        assert text.startswith(head) and text[len(head):].split(user)[0] in ZEN
        assert f"{user}<|start_header_id|>assistant<|end_header_id|>\n\n" in text and "<|im_start|>" not in text


def test_mismatched_reward_processing_classes_length(tmp_path, qwen2_dir, reward_model_dir, qwen3_reward_model_dir):
    """TRL: TestGRPOTrainer.test_mismatched_reward_processing_classes_length. Two reward models, one processing
    class: refused. Changed: ES's message ("must have one entry per reward function"; TRL's says "must match")."""
    with pytest.raises(ValueError, match="reward_processing_classes must have one entry per reward function"):
        ESTrainer(model=qwen2_dir, reward_funcs=[reward_model_dir, qwen3_reward_model_dir],
                  reward_processing_classes=AutoTokenizer.from_pretrained(reward_model_dir), args=init_args(tmp_path),
                  train_dataset=zen(split="train"))


def test_correct_reward_processing_classes_list(tmp_path, qwen2_dir, reward_model_dir, qwen3_reward_model_dir):
    """TRL: TestGRPOTrainer.test_correct_reward_processing_classes_list. One processing class per reward model: kept,
    in order (the very objects)."""
    classes = [AutoTokenizer.from_pretrained(reward_model_dir), AutoTokenizer.from_pretrained(qwen3_reward_model_dir)]
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=[reward_model_dir, qwen3_reward_model_dir],
                        reward_processing_classes=list(classes), args=init_args(tmp_path),
                        train_dataset=zen(split="train"))
    assert len(trainer.reward_processing_classes) == 2
    assert all(ours is given for ours, given in zip(trainer.reward_processing_classes, classes, strict=True))
    assert trainer.reward_func_names == [QWEN2_RM, QWEN3_RM]


def test_single_reward_model_with_single_processing_class(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_single_reward_model_with_single_processing_class. A single processing class (not a
    list) for a single reward model."""
    single_processing_class = AutoTokenizer.from_pretrained(reward_model_dir)
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir,
                        reward_processing_classes=single_processing_class, args=init_args(tmp_path),
                        train_dataset=zen(split="train"))
    assert len(trainer.reward_processing_classes) == 1
    assert trainer.reward_processing_classes[0] is single_processing_class


# ---------------------------------------------------------------------------------------------- reward functions
def test_train_reward_func_standard(tmp_path, qwen2_dir):
    """TRL: TestGRPOTrainer.test_train_reward_func_standard. A length reward on standard prompts: text completions,
    one call per member (3 prompts x 3 generations), and GRPO's reward metrics are these rewards' statistics."""
    @Calls
    def reward_func(completions, **kwargs):
        """Reward function that rewards longer completions."""
        return [float(len(completion)) for completion in completions]

    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_func, args=grpo_args(tmp_path),
                        train_dataset=zen(split="train"))
    previous = params(trainer.model)
    trainer.train()
    assert_trained(trainer, previous, ["reward_func"])
    assert [len(call["completions"]) for call in reward_func.calls] == [9] * 4
    assert all(isinstance(c, str) for call in reward_func.calls for c in call["completions"])
    prompts = reward_func.calls[0]["kwargs"]["prompts"]  # every member scores the same 3 prompts, 3 times each
    assert all(call["kwargs"]["prompts"] == prompts for call in reward_func.calls)
    assert prompts == [p for p in prompts[::3] for _ in range(3)] and set(prompts) < set(ZEN[:17])
    log, rewards = step_logs(trainer)[0], reward_func.rewards
    assert log["reward"] == pytest.approx(statistics.mean(rewards))
    assert log["reward_std"] == pytest.approx(statistics.stdev(rewards))
    assert log["rewards/reward_func/mean"] == pytest.approx(statistics.mean(rewards))
    assert log["rewards/reward_func/std"] == pytest.approx(statistics.stdev(rewards))
    means = member_means(reward_func.calls)
    assert log["fitness/mean"] == pytest.approx(statistics.mean(means))
    assert (log["reward_min"], log["reward_max"]) == pytest.approx((min(means), max(means)))


def test_train_reward_func_conversational(tmp_path, qwen2_dir):
    """TRL: TestGRPOTrainer.test_train_reward_func_conversational. Conversational prompts: completions reach the
    reward function as ``[{"role": "assistant", "content": ...}]``."""
    @Calls
    def reward_func(completions, **kwargs):
        """Reward function that gives higher scores to longer completion content."""
        completion_contents = [completion[0]["content"] for completion in completions]
        return [float(len(content)) for content in completion_contents]

    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_func, args=grpo_args(tmp_path),
                        train_dataset=zen("conversational_prompt_only", split="train"))
    previous = params(trainer.model)
    trainer.train()
    assert_trained(trainer, previous, ["reward_func"])
    for call in reward_func.calls:
        assert all(len(c) == 1 and c[0]["role"] == "assistant" for c in call["completions"])
        assert all(p == [{"role": "user", "content": p[0]["content"]}] for p in call["kwargs"]["prompts"])
    assert step_logs(trainer)[0]["reward"] == pytest.approx(statistics.mean(reward_func.rewards))


def test_train_multiple_reward_funcs(tmp_path, qwen2_dir):
    """TRL: TestGRPOTrainer.test_train_multiple_reward_funcs. Two functions: the weighted reward is their sum
    (default weights 1), each logged under its name."""
    @Calls
    def reward_func1(completions, **kwargs):
        """Reward function that rewards longer completions."""
        return [float(len(completion)) for completion in completions]

    @Calls
    def reward_func2(completions, **kwargs):
        """Reward function that rewards completions with more unique letters."""
        return [float(len(set(completion))) for completion in completions]

    trainer = ESTrainer(model=qwen2_dir, reward_funcs=[reward_func1, reward_func2], args=grpo_args(tmp_path),
                        train_dataset=zen(split="train"))
    previous = params(trainer.model)
    trainer.train()
    assert_trained(trainer, previous, ["reward_func1", "reward_func2"])
    log = step_logs(trainer)[0]
    assert log["rewards/reward_func1/mean"] == pytest.approx(statistics.mean(reward_func1.rewards))
    assert log["rewards/reward_func2/mean"] == pytest.approx(statistics.mean(reward_func2.rewards))
    assert log["reward"] == pytest.approx(statistics.mean(reward_func1.rewards) + statistics.mean(reward_func2.rewards))


def test_train_sync_and_async_reward_funcs(tmp_path, qwen2_dir):
    """TRL: TestGRPOTrainer.test_train_sync_and_async_reward_funcs. Two sync functions (one returning ints) and an
    async one."""
    def sync_reward_func1(completions, **kwargs):
        """Reward function that rewards longer completions."""
        return [float(len(completion)) for completion in completions]

    def sync_reward_func2(completions, **kwargs):
        return [1 for _ in completions]

    async_calls = []

    async def async_reward_func(completions, **kwargs):
        """Async Reward function that rewards completions with more unique letters."""
        await asyncio.sleep(0)
        async_calls.append(len(completions))
        return [float(len(set(completion))) for completion in completions]

    trainer = ESTrainer(model=qwen2_dir, reward_funcs=[sync_reward_func1, sync_reward_func2, async_reward_func],
                        args=grpo_args(tmp_path), train_dataset=zen(split="train"))
    previous = params(trainer.model)
    trainer.train()
    names = ["sync_reward_func1", "sync_reward_func2", "async_reward_func"]
    assert_trained(trainer, previous, names)
    assert async_calls == [9] * 4
    log = step_logs(trainer)[0]
    assert log["rewards/sync_reward_func2/mean"] == 1.0 and log["rewards/sync_reward_func2/std"] == 0.0
    assert log["reward"] == pytest.approx(sum(log[f"rewards/{name}/mean"] for name in names))


def test_train_multiple_reward_funcs_with_None_output(tmp_path, qwen2_dir):
    """TRL: TestGRPOTrainer.test_train_multiple_reward_funcs_with_None_output. A function that returns None for every
    completion ("not applicable") is skipped: the weighted reward is the other function's; it gets no metric."""
    @Calls
    def applicable_reward_func(completions, **kwargs):
        """A reward function that rewards longer completions."""
        return [float(len(completion)) for completion in completions]

    def non_applicable_reward_func(completions, **kwargs):
        """A reward function that returns None for all inputs, as it is not applicable to this sample."""
        return [None] * len(completions)

    trainer = ESTrainer(model=qwen2_dir, reward_funcs=[applicable_reward_func, non_applicable_reward_func],
                        args=grpo_args(tmp_path), train_dataset=zen(split="train"))
    previous = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert_trained(trainer, previous, ["applicable_reward_func"])
    log = step_logs(trainer)[0]
    assert log["reward"] == pytest.approx(statistics.mean(applicable_reward_func.rewards))
    assert "rewards/non_applicable_reward_func/mean" not in log


def test_train_multiple_reward_funcs_with_weights(tmp_path, qwen2_dir):
    """TRL: TestGRPOTrainer.test_train_multiple_reward_funcs_with_weights. reward_weights=[0.7, 0.3]: both functions'
    metrics are logged, and the reward is the weighted sum."""
    @Calls
    def reward_func1(completions, **kwargs):
        """Reward function that rewards longer completions."""
        return [float(len(completion)) for completion in completions]

    @Calls
    def reward_func2(completions, **kwargs):
        """Reward function that rewards completions with more unique letters."""
        return [float(len(set(completion))) for completion in completions]

    trainer = ESTrainer(model=qwen2_dir, reward_funcs=[reward_func1, reward_func2],
                        args=grpo_args(tmp_path, reward_weights=[0.7, 0.3]), train_dataset=zen(split="train"))
    previous = params(trainer.model)
    trainer.train()
    assert_trained(trainer, previous, ["reward_func1", "reward_func2"])
    log = step_logs(trainer)[-1]
    assert log["rewards/reward_func1/mean"] == pytest.approx(statistics.mean(reward_func1.rewards))
    assert log["rewards/reward_func2/mean"] == pytest.approx(statistics.mean(reward_func2.rewards))
    weighted = [0.7 * a + 0.3 * b for a, b in zip(reward_func1.rewards, reward_func2.rewards, strict=True)]
    assert log["reward"] == pytest.approx(statistics.mean(weighted))
    assert log["reward_std"] == pytest.approx(statistics.stdev(weighted))


@pytest.mark.parametrize("multi_objective_aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_reward_metric_reflects_reward_weights(tmp_path, multi_objective_aggregation, qwen2_dir):
    """TRL: TestGRPOTrainer.test_reward_metric_reflects_reward_weights. The logged reward is weighted (0.7 x 1 +
    0.3 x 0 = 0.7, not 1.0). Changed: 'normalize_then_sum' is refused by name (not supported yet); with
    'sum_then_normalize' (ES's way) constant rewards tie every member: the step is bitwise zero."""
    def constant_reward_1(completions, **kwargs):
        return [1.0] * len(completions)

    def constant_reward_0(completions, **kwargs):
        return [0.0] * len(completions)

    def make_args():
        return grpo_args(tmp_path, reward_weights=[0.7, 0.3], multi_objective_aggregation=multi_objective_aggregation)

    if multi_objective_aggregation == "normalize_then_sum":
        with pytest.raises(ValueError, match="^multi_objective_aggregation='normalize_then_sum' is not supported"):
            make_args()
        return
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=[constant_reward_1, constant_reward_0], args=make_args(),
                        train_dataset=zen(split="train"))
    previous = params(trainer.model)
    trainer.train()
    log = step_logs(trainer)[-1]
    assert abs(log["reward"] - 0.7) < 1e-5
    assert log["rewards/constant_reward_1/mean"] == 1.0 and log["rewards/constant_reward_0/mean"] == 0.0
    assert log["fitness/std"] == 0.0
    assert_unchanged(previous, trainer.model)


def test_train_multiple_mixed_reward_funcs(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_multiple_mixed_reward_funcs. A reward function and a reward model (by id)."""
    @Calls
    def reward_func(completions, **kwargs):
        """Reward function that rewards longer completions."""
        return [float(len(completion)) for completion in completions]

    trainer = ESTrainer(model=qwen2_dir, reward_funcs=[reward_func, reward_model_dir], args=grpo_args(tmp_path),
                        train_dataset=zen(split="train"))
    previous = params(trainer.model)
    trainer.train()
    assert_trained(trainer, previous, ["reward_func", QWEN2_RM])
    log = step_logs(trainer)[0]
    assert log["rewards/reward_func/mean"] == pytest.approx(statistics.mean(reward_func.rewards))
    assert log["reward"] == pytest.approx(log["rewards/reward_func/mean"] + log[f"rewards/{QWEN2_RM}/mean"])


def test_train_reward_func_additional_column(tmp_path, qwen2_dir):
    """TRL: TestGRPOTrainer.test_train_reward_func_additional_column. A dataset column reaches the reward function
    as a keyword argument, one value per completion (its prompt's)."""
    dataset = zen(split="train")
    dataset = dataset.add_column("some_values", list(range(len(dataset))))

    @Calls
    def reward_func(completions, some_values, **kwargs):
        """Reward function that rewards completions with lengths closer to the values in some_values."""
        return [float(abs(len(completion) - value)) for completion, value in zip(completions, some_values, strict=True)]

    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_func, args=grpo_args(tmp_path), train_dataset=dataset)
    previous = params(trainer.model)
    trainer.train()
    assert_trained(trainer, previous, ["reward_func"])
    for call in reward_func.calls:
        prompts = call["kwargs"]["prompts"]
        assert [ZEN[value] for value in call["kwargs"]["some_values"]] == prompts


def test_train_with_reward_func_accessing_trainer_state(tmp_path, qwen2_dir):
    """TRL: TestGRPOTrainer.test_train_with_reward_func_accessing_trainer_state. Reward functions receive
    ``trainer_state`` (the trainer's TrainerState; global_step = iterations done). Added: max_steps=2, the steps
    seen."""
    steps = []

    def reward_func(completions, **kwargs):
        trainer_state = kwargs.get("trainer_state")
        assert trainer_state is not None
        # transformers.TrainerState instance should have a `global_step` property.
        assert hasattr(trainer_state, "global_step")
        steps.append(trainer_state.global_step)
        return [float(len(set(completion))) for completion in completions]

    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_func, args=grpo_args(tmp_path, max_steps=2),
                        train_dataset=zen(split="train"))
    trainer.train()
    assert steps == [0] * 4 + [1] * 4


def test_train_reward_func_with_log_extra(tmp_path, qwen2_dir):
    """TRL: TestGRPOTrainer.test_train_reward_func_with_log_extra. log_completions=True and a reward function that
    adds a column with ``log_extra``: the column is in ``trainer._logs["extra"]``. Added: the table's values (every
    member's 9 completions of the iteration), the advantages (each completion's member's coefficient) and the
    parquet file ``completions/completions_00001.parquet``."""
    def reward_func(completions, **kwargs):
        log_extra = kwargs.get("log_extra")
        assert log_extra is not None
        log_extra("test_column", [completion[:5] for completion in completions])
        return [float(len(completion)) for completion in completions]

    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_func, args=grpo_args(tmp_path, log_completions=True),
                        train_dataset=zen(split="train"))
    trainer.train()
    assert "test_column" in trainer._logs["extra"]
    logs = trainer._logs
    assert len(logs["prompt"]) == len(logs["completion"]) == len(logs["advantages"]) == 4 * 9
    assert logs["extra"]["test_column"] == [c[:5] for c in logs["completion"]]
    assert logs["rewards"]["reward_func"] == [float(len(c)) for c in logs["completion"]]
    coefficients = trainer.seed_log.records[-1]["coefficients"]
    assert sorted(set(logs["advantages"])) == sorted(set(coefficients))
    import pandas as pd

    table = pd.read_parquet(os.path.join(trainer.args.output_dir, "completions", "completions_00001.parquet"))
    assert set(table.columns) == {"step", "prompt", "completion", "reward_func", "test_column", "advantage", "member"}
    assert len(table) == 4 * 9 and set(table["step"]) == {1}
    assert list(table["test_column"]) == logs["extra"]["test_column"]


def test_train_reward_func_with_log_metric(tmp_path, qwen2_dir):
    """TRL: TestGRPOTrainer.test_train_reward_func_with_log_metric. ``log_metric(name, value)`` from a reward
    function: averaged into the step's log."""
    def reward_func(completions, **kwargs):
        log_metric = kwargs.get("log_metric")
        assert log_metric is not None
        log_metric("custom_accuracy", 0.75)
        return [float(len(completion)) for completion in completions]

    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_func, args=grpo_args(tmp_path),
                        train_dataset=zen(split="train"))
    trainer.train()
    logged_keys = {k for entry in trainer.state.log_history for k in entry}
    assert "custom_accuracy" in logged_keys
    assert step_logs(trainer)[0]["custom_accuracy"] == 0.75


def test_warning_raised_all_rewards_none(tmp_path, qwen2_dir, caplog):
    """TRL: TestGRPOTrainer.test_warning_raised_all_rewards_none. Every reward None: GRPO's warning (logged by
    trl_es.rollout, once per run). Added: ES's own warning (no member has a fitness), and the step is bitwise zero."""
    def always_none_reward_func(completions, **kwargs):
        """Reward function that always returns None."""
        return [None] * len(completions)

    trainer = ESTrainer(model=qwen2_dir, reward_funcs=always_none_reward_func, args=grpo_args(tmp_path),
                        train_dataset=zen(split="train"))
    previous = params(trainer.model)
    with caplog.at_level("WARNING"):
        trainer.train()
    assert caplog.text.count("All reward functions returned None for the following kwargs:") == 1
    assert "4 of 4 population members have no finite fitness" in caplog.text
    assert step_logs(trainer)[0]["num_nan_members"] == 4
    assert_unchanged(previous, trainer.model)


# ---------------------------------------------------------------------------------------------- generation settings
def test_train_with_additional_generation_kwargs(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_with_additional_generation_kwargs. top_p=0.9, top_k=10, min_p=0.01,
    repetition_penalty=1.1 reach the generation config."""
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir,
                        args=grpo_args(tmp_path, top_p=0.9, top_k=10, min_p=0.01, repetition_penalty=1.1),
                        train_dataset=zen(split="train"))
    config = trainer.generation_config
    assert (config.do_sample, config.temperature, config.top_p, config.top_k, config.min_p,
            config.repetition_penalty) == (True, 1.0, 0.9, 10, 0.01, 1.1)
    previous = params(trainer.model)
    trainer.train()
    assert_trained(trainer, previous, [QWEN2_RM])


def test_train_with_generation_kwargs(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_with_generation_kwargs. generation_kwargs (sampling, top_k, beam search with a
    length penalty) reach generation."""
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir,
                        args=grpo_args(tmp_path, generation_kwargs={"do_sample": True, "top_k": 50, "num_beams": 2,
                                                                    "length_penalty": -0.1}),
                        train_dataset=zen(split="train"))
    config = trainer.generation_config
    assert (config.do_sample, config.top_k, config.num_beams, config.length_penalty) == (True, 50, 2, -0.1)
    previous = params(trainer.model)
    trainer.train()
    assert_trained(trainer, previous, [QWEN2_RM])


def test_train_with_chat_template_kwargs(tmp_path, policy_tokenizer, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_with_chat_template_kwargs. chat_template_kwargs={"enable_thinking": False}
    reaches the chat template of a Qwen3 model (its template pre-fills an empty think block)."""
    import trl_es.rollout

    tokenizer = build_tokenizer(template=QWEN3_TEMPLATE)
    model_dir = save(tiny_model("trl-internal-testing/tiny-Qwen3ForCausalLM", tokenizer), tokenizer,
                     tmp_path / "tiny-Qwen3ForCausalLM")
    prompts_seen = []
    generate = trl_es.rollout.generate_completions

    def spy(model, processing_class, prompts, *args, **kwargs):
        prompts_seen.extend(prompts)
        return generate(model, processing_class, prompts, *args, **kwargs)

    trainer = ESTrainer(model=model_dir, reward_funcs=reward_model_dir,
                        args=grpo_args(tmp_path, chat_template_kwargs={"enable_thinking": False}),
                        train_dataset=zen("conversational_prompt_only", split="train"))
    previous = params(trainer.model)
    with patch.object(trl_es.rollout, "generate_completions", spy):
        trainer.train()
    assert_trained(trainer, previous, [QWEN2_RM])
    assert len(prompts_seen) == 4 * 3
    for prompt in prompts_seen:
        user = prompt.removeprefix("<|im_start|>user\n").split("<|im_end|>")[0]
        assert user in ZEN
        assert prompt == f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_train_num_generations_larger_than_batch_size(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_num_generations_larger_than_batch_size. num_generations=6 with 3 prompts per
    batch. Changed: without gradient_accumulation_steps=2 (it would map GRPO's 3 x 2 completions to 1 prompt per
    iteration; a member's completions of every prompt are generated within the iteration, so no accumulation is
    needed)."""
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir, args=grpo_args(tmp_path, num_generations=6),
                        train_dataset=zen(split="train"))
    previous = params(trainer.model)
    trainer.train()
    assert_trained(trainer, previous, [QWEN2_RM], num_completions=4 * 3 * 6)


def test_train_multiple_dataloader_workers(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_multiple_dataloader_workers. dataloader_num_workers=2 (map-style dataset).
    Changed: the platform's default start method (fork on Linux, Python 3.11) rather than forcing "spawn" for the
    whole session. Added: max_steps=2, the prompts come in dataset order (shuffle_dataset=False)."""
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir,
                        args=grpo_args(tmp_path, dataloader_num_workers=2, max_steps=2, shuffle_dataset=False),
                        train_dataset=zen(split="train"))
    previous = params(trainer.model)
    seen = []
    original = trainer.training_step
    with patch.object(trainer, "training_step",
                      side_effect=lambda model, inputs, *a: seen.append(inputs) or original(model, inputs, *a)):
        trainer.train()
    assert [[row["prompt"] for row in rows] for rows in seen] == [ZEN[0:3], ZEN[3:6]]
    assert_trained(trainer, previous, [QWEN2_RM])


def test_prepare_input_called_with_correct_data(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_prepare_input_called_with_correct_data. shuffle_dataset=False: the prompt batches
    are the dataset's rows in order. Changed: ES has no generation batch reused over steps (steps_per_generation
    and gradient_accumulation_steps map onto prompt_batch_size; num_iterations has no effect): one batch of
    prompt_batch_size=6 rows per iteration, each prompt once (its num_generations=4 copies are made inside the
    rollout)."""
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir,
                        args=grpo_args(tmp_path, prompt_batch_size=6, num_generations=4, shuffle_dataset=False,
                                       max_steps=2),
                        train_dataset=zen(split="train"))
    expected_first_batch = [{"prompt": p} for p in ["Beautiful is better than", "Explicit is", "Simple is better",
                                                    "Complex", "Flat is better than", "Sparse is better"]]
    expected_second_batch = [{"prompt": p} for p in ["Readability", "Special cases aren't special",
                                                     "Although practicality beats", "Errors should never",
                                                     "Unless explicitly", "In the face of ambiguity, refuse"]]
    with patch.object(ESTrainer, "training_step", wraps=trainer.training_step) as mock_prepare:
        trainer.train()
        assert mock_prepare.call_count == 2
        assert mock_prepare.call_args_list[0].args[1] == expected_first_batch
        assert mock_prepare.call_args_list[1].args[1] == expected_second_batch
    assert step_logs(trainer)[0]["completions/mean_length"] > 0


# ---------------------------------------------------------------------------------------------- truncated completions
def test_train_with_mask_truncated_completions(tmp_path, qwen2_dir, policy_tokenizer, monkeypatch):
    """TRL: TestGRPOTrainer.test_train_with_mask_truncated_completions. As TRL, generation is rewritten so that of
    each prompt's 3 completions one is truncated (8 tokens, no EOS), one ends early with EOS and one has EOS as its
    8th token (just within the limit); the model's own tokens stay, so members still differ. With
    mask_truncated_completions=True a member's fitness is the mean reward of its terminated completions only.
    Changed: a content reward (TRL's reward model) and no loss_type="dapo" (ES computes no loss)."""
    import trl_es.rollout
    from trl_es.generation.base import Completions

    eos, pad = policy_tokenizer.eos_token_id, policy_tokenizer.pad_token_id
    special = {eos, pad, policy_tokenizer.bos_token_id}
    filler = policy_tokenizer.convert_tokens_to_ids("x")
    generate = trl_es.rollout.generate_completions

    def fake_generate(model, processing_class, prompts, generation_config, num_generations=1, **kwargs):
        out = generate(model, processing_class, prompts, generation_config, num_generations, **kwargs)
        ids = []
        for j, row in enumerate(out.ids):
            body = [t for t in row if t not in special][:7]
            body += [filler] * (7 - len(body))
            ids.append([body + [filler], body[:3] + [eos], body + [eos]][j % 3])
        return Completions([processing_class.decode(i, skip_special_tokens=True) for i in ids], ids)

    monkeypatch.setattr(trl_es.rollout, "generate_completions", fake_generate)

    @Calls
    def reward_func(completions, **kwargs):
        return [sum(map(ord, c)) / (128 * max(1, len(c))) for c in completions]

    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_func,
                        args=grpo_args(tmp_path, mask_truncated_completions=True), train_dataset=zen(split="train"))
    previous = params(trainer.model)
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    log = step_logs(trainer)[0]
    assert log["completions/clipped_ratio"] == pytest.approx(1 / 3)
    means = member_means(reward_func.calls, keep=lambda ids: ids[-1] == eos)
    assert log["num_nan_members"] == 0
    assert log["fitness/mean"] == pytest.approx(statistics.mean(means))
    assert (log["reward_min"], log["reward_max"]) == pytest.approx((min(means), max(means)))
    assert member_means(reward_func.calls) != pytest.approx(means)  # the truncated ones would change the fitness
    assert_all_changed(previous, trainer.model)


def test_train_with_mask_truncated_completions_all_masked(tmp_path, qwen2_dir, reward_model_dir, policy_tokenizer):
    """TRL: TestGRPOTrainer.test_train_with_mask_truncated_completions_all_masked. Every completion truncated and
    mask_truncated_completions=True: no member has a fitness, the weights do not change (bitwise). Changed: TRL relies
    on its 151k-token vocabulary making EOS improbable; the tiny vocabulary here needs EOS (and pad) suppressed
    (generation_kwargs suppress_tokens); TRL's train_loss == 0 has no ES counterpart (the loss is -mean fitness, and
    no member has one); no loss_type="dapo"."""
    suppressed = [policy_tokenizer.eos_token_id, policy_tokenizer.pad_token_id]
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir,
                        args=grpo_args(tmp_path, mask_truncated_completions=True,
                                       generation_kwargs={"suppress_tokens": suppressed}),
                        train_dataset=zen(split="train"))
    previous = params(trainer.model)
    trainer.train()
    log = step_logs(trainer)[0]
    assert log["completions/clipped_ratio"] == 1.0
    assert log["num_nan_members"] == trainer.args.population_size
    assert_unchanged(previous, trainer.model)


def test_train_with_pad_to_multiple_of(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_with_pad_to_multiple_of. Prompt batches are left-padded to a multiple of 8
    (checked on every generate call) and the model trains. Changed: ES pads prompts only (it has no completion
    tensors of a loss to pad)."""
    trainer = ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir, args=grpo_args(tmp_path, pad_to_multiple_of=8),
                        train_dataset=zen(split="train"))
    widths, generate = [], trainer.model.generate

    def spy(*args, **kwargs):
        widths.append(kwargs["input_ids"].shape[1])
        return generate(*args, **kwargs)

    trainer.model.generate = spy
    previous = params(trainer.model)
    trainer.train()
    assert widths and all(width % 8 == 0 for width in widths)
    assert_trained(trainer, previous, [QWEN2_RM])


# ---------------------------------------------------------------------------------------------- missing pieces
def test_no_reward_source_raises(tmp_path, qwen2_dir):
    """TRL: TestGRPOTrainer.test_no_reward_source_raises. Neither reward_funcs nor an environment-owned get_reward:
    construction fails fast, with GRPO's message. Changed: the tiny Qwen2 stand-in for TRL's tiny Qwen3 (any policy
    does). Added: an environment without get_reward is no reward source either."""
    with pytest.raises(ValueError, match="No reward source provided"):
        ESTrainer(model=qwen2_dir, args=init_args(tmp_path),
                  train_dataset=zen("conversational_prompt_only", split="train"))

    class NoRewardEnvironment:
        def reset(self, **kwargs): ...

    with patch.dict(os.environ, {"TRL_EXPERIMENTAL_SILENCE": "1"}), pytest.raises(ValueError,
                                                                                  match="No reward source provided"):
        ESTrainer(model=qwen2_dir, args=init_args(tmp_path, max_steps=1), environment_factory=NoRewardEnvironment)


def test_dataset_required_without_environment(tmp_path, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_dataset_required_without_environment. No train_dataset (and no environment to own
    the data): training is refused. Changed: ES, as Trainer, constructs without one (for evaluate()) and refuses at
    train() (GRPO refuses at construction, "`train_dataset` is required")."""
    with pytest.raises(ValueError, match="train_dataset"):
        ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir, args=init_args(tmp_path, max_steps=1)).train()


# ---------------------------------------------------------------------------------------------- agents
def agent_args(tmp_path, **kwargs):
    """TRL's GRPOConfig of its tool and environment tests in ES terms: ``per_device_train_batch_size=3`` with
    ``num_generations=3`` is one prompt's 3 rollouts a step (``prompt_batch_size=1``), for 2 members; a character
    tokenizer needs a longer completion budget (a tool call is ~80 tokens). GRPOConfig's ``logging_steps=10``: a
    short run's metrics land in the last entry of ``log_history``, where TRL reads them."""
    defaults = dict(output_dir=str(tmp_path / "out"), prompt_batch_size=1, num_generations=3, population_size=2,
                    max_completion_length=400, sigma=0.02, learning_rate=0.02, max_steps=1,
                    noise_table_size=SMALL_TABLE, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
                    logging_steps=10)
    defaults.update(kwargs)
    return ESConfig(**defaults)


async def async_multiply_tool(a: int, b: int) -> int:
    """
    Asynchronously multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


@pytest.mark.parametrize("tools", [[multiply_tool], [async_multiply_tool]])
def test_train_with_tools(tmp_path, tools, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_with_tools. A (sync or async) tool, a scripted generate: of the 3 rollouts, 2
    call the tool (one succeeds, one fails on a wrong argument name) and are regenerated after the tool turn, one
    answers directly: tools/call_frequency 2/3, tools/failure_frequency 1/2. Changed: a scripted text generate on the
    tiny character-level Llama with TRL's Qwen2.5 template (TRL scripts Qwen3-MoE token ids); every member produces the
    same completions, so the fitness does not differ and ES's step is bitwise zero (TRL: every parameter changed).
    Added: each member generates twice (3 rows, then the 2 that called); a second reward function (constant 0) records
    what the rewards see: the tool results and the answers after them."""
    tok = tool_tokenizer()
    seen = []

    def tool_reward(completions, **kwargs):
        seen.extend(completions)
        return [0.0] * len(completions)

    trainer = ESTrainer(model=tool_model(tok), reward_funcs=[reward_model_dir, tool_reward], args=agent_args(tmp_path),
                        train_dataset=zen("conversational_prompt_only", split="train"), processing_class=tok,
                        tools=tools)
    previous = params(trainer.model)
    tool_name = tools[0].__name__
    first = [tool_call(tool_name, a=3, b=4), tool_call(tool_name, a=3, c=4), "I don't know any tool<|im_end|>"]
    calls = []
    script = scripted(tok, lambda prompt, i: first[i] if turn_of(prompt) == 0 else "Done!<|im_end|>", calls)
    with patch.object(trainer.model, "generate", side_effect=script):
        trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    log = trainer.state.log_history[-1]
    assert log["tools/call_frequency"] == pytest.approx(2 / 3)
    assert log["tools/failure_frequency"] == pytest.approx(1 / 2)
    assert [(len(c), {turn_of(p) for p in c}) for c in calls] == [(3, {0}), (2, {1})] * 2  # per member: 2 turns
    assert len(seen) == 2 * 3
    for completion in seen[:3]:
        assert [m["role"] for m in completion] == ["assistant", "tool", "assistant"][: len(completion)]
    assert [len(c) for c in seen[:3]] == [3, 3, 1]
    assert seen[0][1]["content"] == "12" and "error" in seen[1][1]["content"]
    assert seen[0][2]["content"] == "Done!" and seen[2][0]["content"] == "I don't know any tool"
    assert_unchanged(previous, trainer.model)  # every member the same completions: a zero step


def test_train_with_malformed_tool_calls(tmp_path, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_with_malformed_tool_calls. Three malformed tool calls (no name, a misspelt tag,
    unquoted JSON keys): none is run, so generate is called once (3 rows, never a second turn) and training goes on.
    Changed: scripted text on the tiny character-level Llama (as in test_train_with_tools); ES's step is bitwise zero
    (every member the same completions; TRL: every parameter changed). Added: no call is counted
    (tools/call_frequency 0)."""
    tok = tool_tokenizer()
    trainer = ESTrainer(model=tool_model(tok), reward_funcs=reward_model_dir, args=agent_args(tmp_path),
                        train_dataset=zen("conversational_prompt_only", split="train"), processing_class=tok,
                        tools=[multiply_tool])
    previous = params(trainer.model)
    malformed = ['<tool_call>\n{"arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
                 '<toolcall>\n{"arguments": {"a": 3, "b": 4}}\n</toolcall><|im_end|>',
                 '<tool_call>\n{"arguments": {a: 3, b: 4}}\n</tool_call><|im_end|>']
    calls = []
    with patch.object(trainer.model, "generate", side_effect=scripted(tok, lambda prompt, i: malformed[i], calls)):
        trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert [len(c) for c in calls] == [3, 3]  # one call per member: no second turn
    assert trainer.state.log_history[-1]["tools/call_frequency"] == 0.0
    assert_unchanged(previous, trainer.model)  # every member the same completions: a zero step


def test_train_with_multiple_environments(tmp_path, monkeypatch, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_with_multiple_environments. A dict environment_factory: each row's
    ``environment`` picks its environment, whose tools alone it sees; a batch [counter, counter, echo, echo] calls
    ``increment`` from a counter row and ``shout`` from an echo row (2 calls in 4 rollouts, none failing), each
    dispatched to its own environment; both are reset, without the ``environment`` control field. Changed: scripted
    text (test_train_with_tools); ``trainer.environments.tools`` / ``.pool`` are GRPO's ``_env_tools`` /
    ``_environment_pool``; the calls and resets are counted exactly (2 members x 1 step); ES's step is bitwise zero
    (every member the same completions; TRL: every parameter changed)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    dataset = Dataset.from_dict({"environment": ["counter", "echo"] * 8})
    reset_kwargs_seen = {"counter": [], "echo": []}
    tool_calls_made = {"increment": [], "shout": []}

    class CounterEnvironment:
        def reset(self, **kwargs):
            reset_kwargs_seen["counter"].append(kwargs)
            return "Count."

        def increment(self, step: int) -> int:
            """
            Increment the internal counter.

            Args:
                step: Value to add to the counter.

            Returns:
                The updated counter value.
            """
            tool_calls_made["increment"].append(step)
            return step

    class EchoEnvironment:
        def reset(self, **kwargs):
            reset_kwargs_seen["echo"].append(kwargs)
            return "Echo."

        def shout(self, text: str) -> str:
            """
            Shout the given text.

            Args:
                text: Text to shout.

            Returns:
                The text in upper case.
            """
            tool_calls_made["shout"].append(text)
            return text.upper()

    tok = tool_tokenizer()
    args = agent_args(tmp_path, prompt_batch_size=2, num_generations=2, shuffle_dataset=False)
    trainer = ESTrainer(model=tool_model(tok), reward_funcs=reward_model_dir, args=args, train_dataset=dataset,
                        processing_class=tok,
                        environment_factory={"counter": CounterEnvironment, "echo": EchoEnvironment})
    assert [tool.__name__ for tool in trainer.environments.tools["counter"]] == ["increment"]
    assert [tool.__name__ for tool in trainer.environments.tools["echo"]] == ["shout"]
    assert len(trainer.environments.pool["counter"]) == 1
    assert len(trainer.environments.pool["echo"]) == 1
    previous = params(trainer.model)

    first = [tool_call("increment", step=1), "I won't<|im_end|>", tool_call("shout", text="hi"), "Done!<|im_end|>"]

    def script(prompt, i):
        if turn_of(prompt) == 0:
            assert ("Count." if i < 2 else "Echo.") in prompt  # the batch is [counter, counter, echo, echo]
            return first[i]
        return "Done!<|im_end|>"

    calls = []
    with patch.object(trainer.model, "generate", side_effect=scripted(tok, script, calls)):
        trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert tool_calls_made == {"increment": [1, 1], "shout": ["hi", "hi"]}  # one of each per member
    log = trainer.state.log_history[-1]
    assert log["tools/call_frequency"] == pytest.approx(2 / 4)
    assert log["tools/failure_frequency"] == pytest.approx(0.0)
    assert reset_kwargs_seen == {"counter": [{}] * 4, "echo": [{}] * 4}  # 2 rows of each x 2 members, no field
    assert [len(c) for c in calls] == [4, 2] * 2
    assert_unchanged(previous, trainer.model)  # every member the same completions: a zero step


def test_train_with_unknown_environment_raises(tmp_path, monkeypatch, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_with_unknown_environment_raises. A row whose ``environment`` is not a key of
    the dict environment_factory: train() fails with a clear ValueError, not a KeyError mid-rollout. Changed: the tiny
    character-level Llama with TRL's Qwen2.5 template. Added: the weights are bitwise unchanged."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    dataset = zen("conversational_prompt_only", split="train").map(lambda example: {"environment": "unknown"})

    class CounterEnvironment:
        def reset(self, **kwargs): ...

        def increment(self, step: int) -> int:
            """
            Increment the internal counter.

            Args:
                step: Value to add to the counter.

            Returns:
                The updated counter value.
            """
            return step

    tok = tool_tokenizer()
    trainer = ESTrainer(model=tool_model(tok), reward_funcs=reward_model_dir,
                        args=agent_args(tmp_path, prompt_batch_size=3), train_dataset=dataset, processing_class=tok,
                        environment_factory={"counter": CounterEnvironment})
    previous = params(trainer.model)
    with pytest.raises(ValueError, match="not among the environments"):
        trainer.train()
    assert_unchanged(previous, trainer.model)


class CounterDummyEnvironment:
    """TRL's DummyEnvironment of test_train_with_environment_factory: a counter the ``increment`` tool moves."""

    def reset(self, **kwargs):
        self._counter = 0

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self._counter += step
        return self._counter


def counter_script(tok, calls):
    """TRL's fake_generate of the environment tests: a valid ``increment`` call, a call of a tool that does not
    exist, a plain answer; then "Done!" after the tool turn."""
    first = [tool_call("increment", step=1), tool_call("decrement", step=2), "I won't increment<|im_end|>"]
    return scripted(tok, lambda prompt, i: first[i] if turn_of(prompt) == 0 else "Done!<|im_end|>", calls)


def test_train_with_environment_factory(tmp_path, monkeypatch, reward_model_dir):
    """TRL: TestGRPOTrainer.test_train_with_environment_factory. An environment (no train_dataset: it owns the data,
    max_steps sets the length) whose ``increment`` is a tool: of 3 rollouts, one increments, one calls an unknown tool
    (a failure), one calls none: tools/call_frequency 2/3, tools/failure_frequency 1/2, and the 3 environments'
    counters are 1, 0, 0. Changed: scripted text (test_train_with_tools); GRPO's ``trainer.environments`` (the last
    batch's instances) is ``trainer.environments.pool[None]`` (ES's pool, reset for every member: the counters are the
    last member's); max_steps=2 (TRL: 5); ES's step is bitwise zero (every member the same completions; TRL: every
    parameter changed)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tok = tool_tokenizer()
    trainer = ESTrainer(model=tool_model(tok), reward_funcs=reward_model_dir, args=agent_args(tmp_path, max_steps=2),
                        processing_class=tok, environment_factory=CounterDummyEnvironment)
    previous = params(trainer.model)
    calls = []
    with patch.object(trainer.model, "generate", side_effect=counter_script(tok, calls)):
        trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    log = trainer.state.log_history[-1]
    assert log["tools/call_frequency"] == pytest.approx(2 / 3)
    assert log["tools/failure_frequency"] == pytest.approx(1 / 2)
    environments = trainer.environments.pool[None]
    assert [e._counter for e in environments] == [1, 0, 0]  # incremented once; failed call; no call
    assert [len(c) for c in calls] == [3, 2] * 2 * 2  # 2 steps x 2 members x 2 turns
    assert_unchanged(previous, trainer.model)  # every member the same completions: a zero step


def test_train_with_environment_owned_reward(tmp_path, monkeypatch):
    """TRL: TestGRPOTrainer.test_train_with_environment_owned_reward. test_train_with_environment_factory's setup, but
    the environment owns the reward (``get_reward``, the final counter) and no reward_funcs is given: it is the only
    reward (named after the class, weight 1), ``increment`` is a tool and neither ``reset`` nor ``get_reward`` is;
    counters 1, 0, 0 log rewards/DummyEnvironment/mean 1/3. Changed: scripted text (test_train_with_tools); max_steps=2 (TRL: 5); ES's step is
    bitwise zero (every member the same completions; TRL: every parameter changed)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")

    class DummyEnvironment(CounterDummyEnvironment):
        def get_reward(self) -> float:
            return float(self._counter)

    tok = tool_tokenizer()
    trainer = ESTrainer(model=tool_model(tok), args=agent_args(tmp_path, max_steps=2), processing_class=tok,
                        environment_factory=DummyEnvironment)
    assert trainer.reward_func_names == ["DummyEnvironment"]
    assert trainer.reward_weights.tolist() == [1.0]
    tool_names = [tool.__name__ for tool in trainer.tools]
    assert "increment" in tool_names
    assert "get_reward" not in tool_names
    assert "reset" not in tool_names
    previous = params(trainer.model)
    with patch.object(trainer.model, "generate", side_effect=counter_script(tok, [])):
        trainer.train()

    assert trainer.state.log_history[-1]["rewards/DummyEnvironment/mean"] == pytest.approx(1 / 3)
    assert_unchanged(previous, trainer.model)  # every member the same completions: a zero step


def test_environment_owned_reward_coexists_with_reward_funcs(tmp_path, monkeypatch):
    """TRL: TestGRPOTrainer.test_environment_owned_reward_coexists_with_reward_funcs. reward_funcs and an
    environment's ``get_reward``: the latter comes after them (named after the class) with weight 1, reward_weights
    weighting only the trainer's own; ``guess`` is a tool, ``get_reward`` is not. Changed: the tiny character-level
    Llama with TRL's Qwen2.5 template; max_steps=2 (TRL: 5)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")

    class DummyEnvironment:
        def reset(self, **kwargs):
            self._solved = False

        def guess(self, word: str) -> str:
            """
            Submit a guess.

            Args:
                word: The guessed word.

            Returns:
                Feedback about the guess.
            """
            return "nope"

        def get_reward(self) -> float:
            return 1.0 if self._solved else 0.0

    def format_reward(completions, **kwargs):
        return [0.0 for _ in completions]

    tok = tool_tokenizer()
    trainer = ESTrainer(model=tool_model(tok), reward_funcs=format_reward,
                        args=agent_args(tmp_path, prompt_batch_size=3, max_steps=2, reward_weights=[0.5]),
                        processing_class=tok, environment_factory=DummyEnvironment)
    assert trainer.reward_func_names == ["format_reward", "DummyEnvironment"]
    assert trainer.reward_weights.tolist() == [0.5, 1.0]
    assert len(trainer.reward_funcs) == 2
    tool_names = [tool.__name__ for tool in trainer.tools]
    assert "guess" in tool_names
    assert "get_reward" not in tool_names


def test_environment_owned_reward_mixed_environments(tmp_path, monkeypatch):
    """TRL: TestGRPOTrainer.test_environment_owned_reward_mixed_environments. A dict environment_factory where only
    one class owns its reward, under two names: one reward column for it (deduplicated by class, weight 1) after the
    trainer's, and its reward function scores only rollouts of that class (None for the others, no AttributeError).
    Changed: the tiny character-level Llama with TRL's Qwen2.5 template."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")

    class ScoredEnvironment:  # owns its reward
        def reset(self, **kwargs): ...

        def act(self, x: int) -> int:
            """
            Act.

            Args:
                x: A value.

            Returns:
                The value.
            """
            return x

        def get_reward(self) -> float:
            return 1.0

    class PlainEnvironment:  # no `get_reward`; scored by `reward_funcs`
        def reset(self, **kwargs): ...

        def play(self, x: int) -> int:
            """
            Play.

            Args:
                x: A value.

            Returns:
                The value.
            """
            return x

    def format_reward(completions, **kwargs):
        return [0.0 for _ in completions]

    dataset = Dataset.from_dict({"environment": ["scored", "scored2", "plain"]})
    tok = tool_tokenizer()
    trainer = ESTrainer(model=tool_model(tok), reward_funcs=format_reward,
                        args=agent_args(tmp_path, prompt_batch_size=3), train_dataset=dataset, processing_class=tok,
                        environment_factory={"scored": ScoredEnvironment, "scored2": ScoredEnvironment,
                                             "plain": PlainEnvironment})
    assert trainer.reward_func_names == ["format_reward", "ScoredEnvironment"]
    assert trainer.reward_weights.tolist() == [1.0, 1.0]
    env_reward_func = trainer.reward_funcs[-1]
    rewards = env_reward_func(environments=[ScoredEnvironment(), PlainEnvironment()])
    assert rewards == [1.0, None]


def test_environment_owned_data_requires_max_steps(tmp_path, monkeypatch, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_environment_owned_data_requires_max_steps. An environment owns the data (no
    train_dataset) and max_steps is unset: construction fails, naming max_steps. Changed: the tiny Qwen2 stand-in for
    TRL's tiny Qwen3."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")

    class DummyEnvironment:
        def reset(self, **kwargs):
            return "Guess the 5-letter word."

    with pytest.raises(ValueError, match="max_steps"):
        ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir, args=init_args(tmp_path),  # max_steps unset
                  environment_factory=DummyEnvironment)


def test_multiple_environments_without_dataset_raises(tmp_path, monkeypatch, qwen2_dir, reward_model_dir):
    """TRL: TestGRPOTrainer.test_multiple_environments_without_dataset_raises. A dict environment_factory without a
    train_dataset (no ``environment`` column to route the rows): construction fails with a clear message. Changed: the
    tiny Qwen2 stand-in for TRL's tiny Qwen3."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")

    class EnvA:
        def reset(self, **kwargs): ...

    class EnvB:
        def reset(self, **kwargs): ...

    with pytest.raises(ValueError, match="requires a `train_dataset`"):
        ESTrainer(model=qwen2_dir, reward_funcs=reward_model_dir, args=init_args(tmp_path, max_steps=1),
                  environment_factory={"a": EnvA, "b": EnvB})


def test_train_with_environment_owned_data(tmp_path, monkeypatch):
    """TRL: TestGRPOTrainer.test_train_with_environment_owned_data. The environment owns the data: no train_dataset,
    ``reset()`` returns the prompt, max_steps sets the length; completions of 3 lengths are scored by their length.
    Changed: scripted text on the tiny character-level Llama (TRL scripts token ids; max_completion_length=16
    characters, TRL: 8 tokens); max_steps=2 (TRL: 5); ES's step is bitwise zero (every member the same completions;
    TRL: every parameter changed). Added: every prompt is the reset's, and the rewards are 5, 9, 13."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")

    class GuessTheWordEnvironment:
        def reset(self, **kwargs):
            return "Guess the 5-letter word."  # the env owns the data and returns the prompt

    texts = ["Done!<|im_end|>", "DoneDone!<|im_end|>", "DoneDoneDone!<|im_end|>"]
    rewards = []

    def reward_len(completions, **kwargs):
        out = [float(len(completion[-1]["content"])) for completion in completions]
        rewards.append(out)
        return out

    tok = tool_tokenizer()
    trainer = ESTrainer(model=tool_model(tok), reward_funcs=reward_len,
                        args=agent_args(tmp_path, max_steps=2, max_completion_length=16), processing_class=tok,
                        environment_factory=GuessTheWordEnvironment)
    previous = params(trainer.model)
    calls = []
    with patch.object(trainer.model, "generate", side_effect=scripted(tok, lambda prompt, i: texts[i % 3], calls)):
        trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert all("Guess the 5-letter word." in prompt for call in calls for prompt in call)
    assert rewards == [[5.0, 9.0, 13.0]] * 2 * 2  # 2 steps x 2 members
    assert_unchanged(previous, trainer.model)  # every member the same completions: a zero step


# ---------------------------------------------------------------------------------------------- rollout_func
def rollout_func_trainer(tmp_path, rollout_func, reward_funcs):
    """An ESTrainer with ``rollout_func`` on the tiny character-level Llama, whose generate must not run."""
    tok = char_tokenizer()
    model = build_llama(tok)
    model.generate = MagicMock(side_effect=AssertionError("generate called despite rollout_func"))
    args = agent_args(tmp_path, num_generations=1, max_completion_length=8)
    return ESTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=zen(split="train"),
                     processing_class=tok, rollout_func=rollout_func)


def test_generate_prefers_rollout_func(tmp_path, monkeypatch):
    """TRL: TestGRPOTrainer.test_generate_prefers_rollout_func. With a rollout_func, a rollout calls it once with the
    prompts and the trainer instead of generating, and its prompt_ids and completion_ids are the rollout's. Changed:
    TRL's class is TestGRPORolloutDispatch, which calls ``GRPOTrainer._generate`` on a bare trainer; here a real
    ESTrainer's ``trainer.rollout(trainer.model, rows)`` (one member's rollout), generate unused; ES ignores logprobs
    and env_mask (no loss, no token masks; GRPO's tool_mask). Added: what the rewards see (the decoded completion and
    an extra field, neither logprobs nor env_mask)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    seen = []

    def reward(completions, **kwargs):
        seen.append((completions, kwargs))
        return [0.0] * len(completions)

    rollout_func = MagicMock(return_value={"prompt_ids": [[1]], "completion_ids": [[2]], "logprobs": [[-0.1]],
                                           "env_mask": [[1]], "tag": ["x"]})
    trainer = rollout_func_trainer(tmp_path, rollout_func, reward)
    result = trainer.rollout(trainer.model, [{"prompt": "prompt"}])

    assert result.prompt_lengths == [1]  # prompt_ids
    assert result.completion_ids == [[2]]  # completion_ids
    rollout_func.assert_called_once_with(["prompt"], trainer)
    trainer.model.generate.assert_not_called()
    (completions, kwargs), = seen
    assert completions == [""] and kwargs["completion_ids"] == [[2]]  # id 2 is the tiny tokenizer's EOS
    assert kwargs["tag"] == ["x"] and "logprobs" not in kwargs and "env_mask" not in kwargs


def test_generate_rollout_func_raises_when_required_keys_are_missing(tmp_path, monkeypatch):
    """TRL: TestGRPOTrainer.test_generate_rollout_func_raises_when_required_keys_are_missing. A rollout_func output
    without a required key: ValueError naming it. Changed: TRL's class is TestGRPORolloutDispatch (a bare trainer's
    ``_generate``; here ``trainer.rollout``); ES needs no logprobs, so only prompt_ids and completion_ids are required:
    TRL's output (no logprobs) is accepted, one without completion_ids is refused."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    rollout_func = MagicMock(return_value={"prompt_ids": [[1]], "completion_ids": [[2]]})
    trainer = rollout_func_trainer(tmp_path, rollout_func, lambda completions, **kwargs: [0.0] * len(completions))
    assert trainer.rollout(trainer.model, [{"prompt": "prompt"}]).completion_ids == [[2]]

    rollout_func.return_value = {"prompt_ids": [[1]]}
    with pytest.raises(ValueError, match=re.escape("rollout_func must return keys ['completion_ids']")):
        trainer.rollout(trainer.model, [{"prompt": "prompt"}])
