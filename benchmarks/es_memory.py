"""Peak memory of one training process: ES (ESTrainer) vs TRL's GRPOTrainer on the same model, batch and length.

Each variant runs in a fresh subprocess (so one peak cannot hide another). On CPU the measure is the peak resident
set size, ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (``tracemalloc`` does not see torch's allocations); with
``--device cuda`` it is ``torch.cuda.max_memory_allocated``. Variants, each in fp32 and bf16 (``--dtypes``):

- ``load``: imports and the model loaded, every weight read once (the floor any trainer pays);
- ``es_default``: ``ESConfig`` with the defaults a user gets (sequential full-rank members, ``noise_source='auto'``,
  drift logging with theta_0 read from the checkpoint file, an fp32 master for bf16 weights);
- ``es_lean``: the lean mode of docs/scaling.md: ``lean_memory=True``, ``population_backend='batched_lowrank'``
  (no master copy of fp32 weights), and for bf16 ``fp32_master_weights=False`` (no master at all);
- ``grpo``: TRL's ``GRPOTrainer`` with its default AdamW;
- ``load_4bit``, ``es_4bit``, ``grpo_qlora`` (issue 60): the base in 4 bits (bitsandbytes NF4, compute dtype
  float32; the embeddings and ``lm_head`` stay in the measured dtype, as transformers keeps them) with TRL's
  ``--use_peft`` LoRA (r 16, alpha 32, q_proj and v_proj): the load alone, ``ESTrainer`` with its defaults over the
  fp32 adapter, and TRL's ``GRPOTrainer`` (QLoRA: its adapter cast to bf16, AdamW over it). They load a 4-bit
  checkpoint (the model quantized and saved once, in a process of its own, as the hub's ``*-bnb-4bit`` checkpoints
  are): quantizing at load time would read the whole 16/32-bit checkpoint into the process first.
  ``grpo_qlora_rowmajor`` is ``grpo_qlora`` with the ``lm_head`` reading a row-major input for the whole run, as
  ESTrainer's generation gives it (``trl_es.generation.standard_strided_head_input``): PyTorch's CPU ``linear``
  copies a 16-bit head once per row for the prefill's last-position slice, in GRPO's generation as in any other.

Every trainer makes the same number of completions per step (``--completions``, each ``--new_tokens`` tokens): ES
scores ``--population_size`` members, each on ``--completions`` prompts; GRPO generates ``--num_generations``
completions for each of ``--completions / --num_generations`` prompts, then takes one optimizer step. The model is
read from a safetensors folder in the measured dtype (default: the embedded SmolLM2-135M-Instruct, saved in bf16 for
the bf16 runs; ``--random_init`` builds the
SmolLM2-135M config with random weights and saves it to a temporary folder first; ``--scale`` multiplies its
hidden size and layer count for the largest-model search). ``--shape`` picks the architecture of the random model
(implies ``--random_init``; no download, the configs are written below): ``smollm2-135m`` (the default),
``qwen2.5-0.5b``, ``qwen2.5-1.5b`` or ``qwen2.5-7b`` (the Qwen2.5 base models' shapes, their 151,936-token
vocabulary kept (7B: 152,064, untied head): the SmolLM2 tokenizer's 49,152 ids are a subset of it, so generated
ids above it decode to nothing, which changes no memory figure; 494,032,768, 1,543,714,304 and 7,615,616,512
parameters). The random model is built and saved in a subprocess of its own, so the parent holds no copy of it while
the measured processes run (the 7B shape tensor by tensor, into 2 GB shards: it never exists whole in memory).
Goals (issue): ES/GRPO <= 0.5 with the defaults, <= 0.35 in lean mode, both dtypes; issue 60: es_4bit/grpo_qlora
<= 0.5 at 1.5B, a 7B shape under 8 GiB.

For ES the time split of every iteration (``time/perturb``, ``time/generation_and_reward``, ``time/restore``,
``time/update``, ``time/other`` of ``ESTrainer``'s logs) is recorded and the last iteration's is printed (use
``--iterations 2`` for one after warm-up); every variant also records the wall time of ``trainer.train()``.

    python benchmarks/es_memory.py                           # embedded model, fp32 and bf16
    python benchmarks/es_memory.py --variants es_lean grpo --dtypes bfloat16 --random_init --scale 4
    python benchmarks/es_memory.py --shape qwen2.5-0.5b --completions 4 --new_tokens 8 --iterations 2
    python benchmarks/es_memory.py --shape qwen2.5-1.5b --dtypes float32 --variants load_4bit es_4bit grpo_qlora \
        es_lean es_default --completions 4 --new_tokens 8                   # ES on a 4-bit base (issue 60)
    python benchmarks/es_memory.py --shape qwen2.5-7b --dtypes bfloat16 --variants load_4bit es_4bit \
        --completions 4 --new_tokens 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

VARIANTS = ("load", "es_default", "es_lean", "grpo", "load_4bit", "es_4bit", "grpo_qlora", "grpo_qlora_rowmajor")
QUANTIZED = ("load_4bit", "es_4bit", "grpo_qlora", "grpo_qlora_rowmajor")
HERE = os.path.dirname(os.path.abspath(__file__))
# Qwen2.5 base models' shapes (their config.json: Qwen2 architecture, q/k/v biases, tied embeddings). Token ids are the
# SmolLM2 tokenizer's (bos 1, eos/pad 2), which every random model here is saved with.
QWEN2_5 = {"model_type": "qwen2", "vocab_size": 151936, "hidden_act": "silu", "max_position_embeddings": 32768,
           "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
           "tie_word_embeddings": True, "use_sliding_window": False, "attention_dropout": 0.0,
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
SHAPES = {
    "smollm2-135m": None,  # smollm2_135m_config.json
    "qwen2.5-0.5b": {**QWEN2_5, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2},
    "qwen2.5-1.5b": {**QWEN2_5, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2},
    "qwen2.5-7b": {**QWEN2_5, "vocab_size": 152064, "tie_word_embeddings": False, "hidden_size": 3584,
                   "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4},
}
#: Shapes saved tensor by tensor (never whole in memory).
STREAMED = ("qwen2.5-7b",)


def peak_mib(device: str) -> float:
    """Peak memory of this process in MiB: resident set size on CPU (Linux reports KiB), allocated bytes on CUDA."""
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def save_random_model(folder: str, scale: float, dtype: str, shape: str = "smollm2-135m") -> str:
    """The config of ``shape`` (``SHAPES``; ``smollm2-135m``: ``smollm2_135m_config.json``, whose hidden size,
    intermediate size and layers ``scale`` multiplies, hidden size and heads kept divisible), random weights, saved
    as safetensors with the embedded model's tokenizer when it is installed, else the word-level tokenizer of
    ``population_throughput.py``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if SHAPES[shape] is not None:
        if scale != 1:
            raise ValueError("--scale applies to the smollm2-135m shape only")
        fields = dict(SHAPES[shape])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        config = AutoConfig.from_pretrained(os.path.join(HERE, "smollm2_135m_config.json"))
    if scale != 1:
        heads = max(1, round(config.num_attention_heads * scale ** 0.5))
        kv = max(1, min(heads, round(config.num_key_value_heads * scale ** 0.5)))
        while heads % kv:
            kv -= 1
        config.num_attention_heads, config.num_key_value_heads = heads, kv
        config.hidden_size = heads * config.head_dim
        config.intermediate_size = int(config.intermediate_size * config.hidden_size / 576) // 64 * 64
        config.num_hidden_layers = max(1, round(config.num_hidden_layers * scale ** 0.5))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(folder)
    try:
        from trl_es.models import embedded_model_path
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(embedded_model_path()).save_pretrained(folder)
    except ImportError:
        sys.path.insert(0, HERE)
        from population_throughput import random_token_tokenizer

        random_token_tokenizer(config.vocab_size).save_pretrained(folder)
    return folder


def save_streamed_random_model(folder: str, dtype: str, shape: str, shard_bytes: int = 2 * 2**30) -> str:
    """``shape``'s config with random weights (normal, std 0.02; norms 1), built on the meta device and written one
    tensor at a time into safetensors shards with an index, so the model never exists whole in memory."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from trl_es.models import embedded_model_path

    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(0)
    weight_map, shard, size, index = {}, {}, 0, 0

    def flush():
        nonlocal shard, size, index
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard, size, index = {}, 0, index + 1

    os.makedirs(folder, exist_ok=True)
    for name, param in skeleton.state_dict().items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(param.shape, dtype=getattr(torch, dtype))
        elif name.endswith("bias"):
            tensor = torch.zeros(param.shape, dtype=getattr(torch, dtype))
        else:
            tensor = torch.empty(param.shape, dtype=getattr(torch, dtype)).normal_(0, 0.02, generator=generator)
        shard[name] = tensor
        size += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            flush()
    flush()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config.dtype = dtype
    config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(embedded_model_path()).save_pretrained(folder)
    return folder


def save_quantized_copy(source: str, folder: str, dtype: str) -> str:
    """``source`` loaded in 4 bits (bitsandbytes NF4, compute dtype float32; the rest in ``dtype``) and saved as a
    4-bit checkpoint with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype), quantization_config=config)\
        .save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def save_copy(model_name: str | None, folder: str, dtype: str) -> str:
    """The model (default: the embedded one) saved in ``dtype`` with its tokenizer, so that a run loads weights of
    that dtype as a user with such a checkpoint would (loading fp32 weights and casting has a larger peak)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_es.models import resolve_model_path

    path = resolve_model_path(model_name)
    AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(path).save_pretrained(folder)
    return folder


def worker(cli) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from trl_es.models import resolve_model_path
    from trl_es.tasks.arithmetic import arithmetic_reward, make_arithmetic_dataset

    hf_logging.set_verbosity_error()
    torch.set_num_threads(cli.threads)
    path = resolve_model_path(cli.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    peft_config = None
    if cli.worker in QUANTIZED:  # issue 60: a 4-bit NF4 checkpoint (its config holds the quantization config)
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM")  # TRL's ModelConfig defaults
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, cli.dtype))
    if peft_config is None:
        model = model.to(cli.device)
    else:
        assert model.is_loaded_in_4bit, "the quantized variants load a 4-bit checkpoint"
    dataset = make_arithmetic_dataset(cli.completions * cli.iterations, seed=0)
    out_dir = tempfile.mkdtemp()
    common = {"output_dir": out_dir, "max_steps": cli.iterations, "max_completion_length": cli.new_tokens,
              "report_to": [], "save_strategy": "no", "disable_tqdm": True, "bf16": False, "seed": 0,
              "generation_kwargs": {"min_new_tokens": cli.new_tokens}, "use_cpu": cli.device == "cpu"}
    info = {"variant": cli.worker, "dtype": cli.dtype, "parameters": sum(p.numel() for p in model.parameters())}
    if cli.worker.startswith("es"):
        from trl_es import ESConfig, ESTrainer

        lean = cli.worker == "es_lean"
        extra = {"lean_memory": True, "population_backend": "batched_lowrank"} if lean else {}
        if lean and cli.dtype != "float32":
            extra["fp32_master_weights"] = False
        args = ESConfig(population_size=cli.population_size, prompt_batch_size=cli.completions, **extra, **common)
        trainer = ESTrainer(model, arithmetic_reward, args=args, train_dataset=dataset, processing_class=tokenizer,
                            peft_config=peft_config)
        start = time.perf_counter()
        trainer.train()
        info["train_seconds"] = time.perf_counter() - start
        info["iteration_times"] = [{k: v for k, v in row.items() if k.startswith("time/")}
                                   for row in trainer.state.log_history if "time/perturb" in row]
        info["setup"] = (f"population {cli.population_size} x {cli.completions} prompts x {cli.new_tokens} tokens, "
                         f"backend {args.population_backend}, noise {trainer.noise.describe()['type']}, master "
                         f"{trainer.es_params.master_bytes / 2**20:.0f} MiB, anchor "
                         f"{'none' if trainer.anchor is None else trainer.anchor.storage}")
    elif cli.worker.startswith("grpo"):
        from trl import GRPOConfig, GRPOTrainer

        from trl_es.generation import standard_strided_head_input

        args = GRPOConfig(per_device_train_batch_size=cli.completions, num_generations=cli.num_generations,
                          temperature=1.0, **common)
        trainer = GRPOTrainer(model=model, reward_funcs=arithmetic_reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer, peft_config=peft_config)
        rowmajor = cli.worker == "grpo_qlora_rowmajor"  # ESTrainer's generation hook on the head, for the whole run
        start = time.perf_counter()
        with standard_strided_head_input(model) if rowmajor else contextlib.nullcontext():
            trainer.train()
        info["train_seconds"] = time.perf_counter() - start
        info["setup"] = (f"{cli.completions // cli.num_generations} prompts x {cli.num_generations} generations x "
                         f"{cli.new_tokens} tokens, optim {args.optim}, beta {args.beta}"
                         + (", row-major head input" if rowmajor else ""))
    else:
        with torch.no_grad():
            for param in model.parameters():  # make the memory-mapped weights resident, as training does
                param.sum()
        info["setup"] = "imports + model load only" + (" (4-bit NF4 checkpoint)" if peft_config else "")
    info["peak_mib"] = peak_mib(cli.device)
    return info


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Model id/path (default: the embedded SmolLM2-135M-Instruct).")
    parser.add_argument("--random_init", action="store_true", help="The SmolLM2-135M config with random weights.")
    parser.add_argument("--scale", type=float, default=1.0, help="--random_init: scale of the model (see doc).")
    parser.add_argument("--shape", default=None, choices=list(SHAPES),
                        help="Architecture of the random model (implies --random_init; default smollm2-135m).")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--completions", type=int, default=8, help="Completions per step (ES: prompts per member).")
    parser.add_argument("--num_generations", type=int, default=2, help="GRPO completions per prompt.")
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--population_size", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output_json", default=None, help="Also write every figure here.")
    parser.add_argument("--worker", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--build_to", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--quantize_from", default=None, help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.shape:
        cli.random_init = True
    shape = cli.shape or "smollm2-135m"

    from trl_es.files import write_json
    from trl_es.models import resolve_model_path

    if cli.build_to and cli.quantize_from:  # the 4-bit checkpoint of the quantized variants, in its own process
        save_quantized_copy(cli.quantize_from, cli.build_to, cli.dtype)
        return
    if cli.build_to:  # build and save the random model in a process of its own, then exit (frees it all)
        if shape in STREAMED:
            save_streamed_random_model(cli.build_to, cli.dtype, shape)
        else:
            save_random_model(cli.build_to, cli.scale, cli.dtype, shape)
        return
    if cli.worker:  # one plain process (no launcher): the result is complete or absent
        write_json(cli.result, worker(cli), indent=None)
        return

    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for dtype in cli.dtypes:
            model = cli.model
            if cli.random_init:
                model = os.path.join(scratch, dtype)
                subprocess.run([sys.executable, os.path.abspath(__file__), "--build_to", model, "--dtype", dtype,
                                "--shape", shape, "--scale", str(cli.scale)], check=True)
            elif dtype != "float32":  # load a checkpoint in that dtype: no fp32 load-then-cast peak
                model = save_copy(cli.model, os.path.join(scratch, dtype), dtype)
            quantized_model = None
            if any(v in QUANTIZED for v in cli.variants):  # one 4-bit checkpoint for the quantized variants
                quantized_model = os.path.join(scratch, f"{dtype}-nf4")
                source = model or resolve_model_path(cli.model)
                subprocess.run([sys.executable, os.path.abspath(__file__), "--quantize_from", source, "--build_to",
                                quantized_model, "--dtype", dtype], check=True)
            for variant in cli.variants:
                result_path = os.path.join(scratch, f"{variant}-{dtype}.json")
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--result", result_path,
                       "--dtype", dtype]
                for key in ("completions", "num_generations", "new_tokens", "population_size", "iterations",
                            "threads", "device"):
                    cmd += [f"--{key}", str(getattr(cli, key))]
                if variant in QUANTIZED:
                    cmd += ["--model", quantized_model]
                elif model:
                    cmd += ["--model", model]
                proc = subprocess.run(cmd, check=False)
                if proc.returncode != 0:
                    results[(variant, dtype)] = {"peak_mib": float("nan"), "setup": f"failed (exit {proc.returncode})"}
                    print(f"{variant:>10} {dtype:>8}: FAILED (exit {proc.returncode}; killed for memory?)", flush=True)
                    continue
                with open(result_path) as f:
                    results[(variant, dtype)] = json.load(f)
                r = results[(variant, dtype)]
                print(f"{variant:>10} {dtype:>8}: peak {r['peak_mib']:9.1f} MiB  ({r['setup']})", flush=True)
                if r.get("iteration_times"):
                    last = r["iteration_times"][-1]
                    print(f"{'':>20} iteration {len(r['iteration_times'])} (s): " + ", ".join(
                        f"{k[5:]} {v:.2f}" for k, v in last.items()), flush=True)

    first = next((r for r in results.values() if "parameters" in r), {})
    name = f"random init {shape}" + (f" x{cli.scale}" if cli.scale != 1 else "")
    print(f"model: {cli.model or (name if cli.random_init else 'embedded SmolLM2-135M')}, "
          f"{first.get('parameters', 0):,} parameters; device {cli.device}; {cli.iterations} iteration(s)")
    for dtype in cli.dtypes:
        grpo = results.get(("grpo", dtype), {}).get("peak_mib")
        load = results.get(("load", dtype), {}).get("peak_mib")
        for variant, goal in (("es_default", 0.5), ("es_lean", 0.35)):
            es = results.get((variant, dtype), {}).get("peak_mib")
            if es and grpo:
                above = f"; above the loaded model: {(es - load) / (grpo - load):.3f}" if load else ""
                print(f"{dtype}: {variant} / grpo peak = {es / grpo:.3f} (goal <= {goal}){above}")
        es4 = results.get(("es_4bit", dtype), {}).get("peak_mib")
        for variant in ("grpo_qlora", "grpo_qlora_rowmajor"):
            qlora = results.get((variant, dtype), {}).get("peak_mib")
            if es4 and qlora:
                print(f"{dtype}: es_4bit / {variant} peak = {es4 / qlora:.3f} (goal <= 0.5 at 1.5B)")
        for variant in ("es_4bit", "es_default", "es_lean"):
            es = results.get((variant, dtype), {}).get("peak_mib")
            if es and es4 and variant != "es_4bit":
                print(f"{dtype}: es_4bit / {variant} peak = {es4 / es:.3f}")
        if es4:
            print(f"{dtype}: es_4bit peak = {es4 / 1024:.2f} GiB (goal for a 7B shape: < 8 GiB)")
    if cli.output_json:
        write_json(cli.output_json, {f"{v}/{d}": r for (v, d), r in results.items()})


if __name__ == "__main__":
    main()
