"""ESConfig's vLLM fields and what happens without vLLM (runs in the main environment, no vLLM needed)."""

import pytest

from trl_es import ESConfig, ESTrainer
from trl_es.generation.vllm_engine import LORA_RANKS, is_vllm_available, lora_slot_rank


def config(tmp_path, **kwargs):
    return ESConfig(output_dir=str(tmp_path), report_to=[], noise_table_size=1 << 20, **kwargs)


def test_vllm_fields_default_to_trl_values(tmp_path):
    args = config(tmp_path)
    assert args.use_vllm is False and args.vllm_mode == "colocate"
    assert (args.vllm_gpu_memory_utilization, args.vllm_tensor_parallel_size, args.vllm_max_model_length) == (0.3, 1, None)
    assert args.vllm_kv_cache_memory_bytes is None


@pytest.mark.parametrize(("field", "value", "message"), [
    ("vllm_mode", "remote", r"vllm_mode must be one of \('colocate', 'server'\)"),
    ("vllm_gpu_memory_utilization", 0.0, r"vllm_gpu_memory_utilization must be in \(0, 1\]"),
    ("vllm_gpu_memory_utilization", 1.5, r"vllm_gpu_memory_utilization must be in \(0, 1\]"),
    ("vllm_tensor_parallel_size", 0, "vllm_tensor_parallel_size must be an integer >= 1"),
    ("vllm_max_model_length", 0, "vllm_max_model_length must be None or an integer >= 1"),
    ("vllm_kv_cache_memory_bytes", -1, "vllm_kv_cache_memory_bytes must be None or an integer >= 1"),
    ("vllm_model_impl", "transformers", r"vllm_model_impl='transformers' is not supported by ES yet.*'vllm'"),
    ("vllm_model_impl", "mine", r"vllm_model_impl must be one of \('vllm',\)"),
    ("vllm_structured_outputs_regex", "[0-9", "vllm_structured_outputs_regex='\\[0-9' is not a regular expression"),
])
def test_bad_vllm_settings_are_named(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, **{field: value})


def test_server_mode_settings_are_checked(tmp_path):
    args = config(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url="http://10.0.0.2:8000")
    assert (args.vllm_server_host, args.vllm_server_port, args.vllm_server_timeout) == ("0.0.0.0", 8000, 240.0)
    with pytest.raises(ValueError, match="vllm_mode='server' writes full-rank members.*got 'batched_lowrank'"):
        config(tmp_path, use_vllm=True, vllm_mode="server", population_backend="batched_lowrank")
    with pytest.raises(ValueError, match="vllm_server_base_urls must be None or a list of distinct URLs"):
        config(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_urls=["http://a:1", "http://a:1"])
    with pytest.raises(ValueError, match="vllm_server_timeout must be a number of seconds >= 0, got -1"):
        config(tmp_path, vllm_server_timeout=-1)
    with pytest.raises(ValueError, match="vllm_server_port must be an integer >= 1, got 0"):
        config(tmp_path, vllm_server_port=0)


def test_vllm_with_another_generation_engine_is_refused(tmp_path):
    with pytest.raises(ValueError, match="leave generation_engine at 'auto'"):
        config(tmp_path, use_vllm=True, generation_engine="eager")


def test_lora_slot_rank_is_the_smallest_vllm_accepts():
    assert [lora_slot_rank(r) for r in (1, 2, 4, 8, 9, 512)] == [1, 8, 8, 8, 16, 512]
    assert LORA_RANKS[0] == 1
    with pytest.raises(ValueError, match="noise_rank=513"):
        lora_slot_rank(513)


@pytest.mark.skipif(is_vllm_available(), reason="vLLM is installed here")
def test_missing_vllm_names_what_to_install(tmp_path, tiny_llama, tokenizer):
    from datasets import Dataset

    args = config(tmp_path, use_vllm=True, population_size=2, prompt_batch_size=2, max_steps=1)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[vllm\]".*setup_vllm_env\.sh'):
        ESTrainer(tiny_llama, lambda completions, **k: [0.0] * len(completions), args=args,
                  train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}), processing_class=tokenizer)


def test_structured_outputs_need_the_vllm_engine(tmp_path):
    with pytest.raises(ValueError, match="vllm_structured_outputs_regex constrains vLLM's sampler: set use_vllm=True"):
        config(tmp_path, vllm_structured_outputs_regex="[0-9]+")
