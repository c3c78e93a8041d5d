"""The throughput benchmark runs where the embedded weights are not installed (--random_init), in CI time."""

import json
import os
import sys
from paths import REPO

ROOT = REPO


def test_population_throughput_random_init_runs_on_cpu(tmp_path, warm_python):
    out = tmp_path / "throughput.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "population_throughput.py"), "--random_init",
           "--population", "2", "--prompts", "2", "--new_tokens", "2", "--prompt_tokens", "12",
           "--shared_prefix_tokens", "8", "--share_prompt_prefix", "--threads", "1", "--device", "cpu",
           "--output_json", str(out)]
    proc = warm_python.run(cmd[1:], cwd=os.getcwd(), timeout=600)  # `python script.py`, libraries already imported
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    rates = figures["completions_per_second"]
    assert set(rates) == {"(a) plain generate", "(b) sequential full-rank", "(c) batched low-rank"}
    assert all(rate > 0 for rate in rates.values())
    assert figures["engine"] == {"name": "eager", "share_prompt_prefix": True}
    assert "(c)/(a)" in proc.stdout and "[eager]" in proc.stdout


def test_top_p_speed_reports_each_variant_and_equal_kept_sets(tmp_path, warm_python):
    out = tmp_path / "top_p.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "top_p_speed.py"), "--rows", "6", "--vocab", "2000",
           "--candidates", "64", "--repeats", "1", "--threads", "1", "--output_file", str(out)]
    proc = warm_python.run(cmd[1:], cwd=os.getcwd(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert set(figures["seconds_per_step"]) == {"torch_sort", "torch_topk", "transformers_top_p", "candidate_top_p",
                                                "transformers_draw", "candidate_sampler"}
    assert all(seconds > 0 for seconds in figures["seconds_per_step"].values())
    assert figures["same_kept_sets"] is True and figures["fallback_rows_per_step"] == 0.0
    assert figures["candidate_sampler_draws_in_nucleus"] is True
    assert 1 <= figures["mean_kept_tokens"] <= 64


def test_es_memory_shapes_have_the_qwen2_5_parameter_counts():
    """The --shape configs of es_memory.py (built on the meta device: no weights, no run)."""
    import importlib.util

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = importlib.util.spec_from_file_location("es_memory", os.path.join(ROOT, "benchmarks", "es_memory.py"))
    es_memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(es_memory)
    expected = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-7b": 7_615_616_512}
    for shape, count in expected.items():
        fields = dict(es_memory.SHAPES[shape])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert sum(p.numel() for p in model.parameters()) == count
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        assert tied is (shape != "qwen2.5-7b")  # Qwen2.5-7B unties its head
