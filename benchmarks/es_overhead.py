"""ES overhead: how much of an ES iteration is *not* generation.

Runs ESTrainer iterations and splits each iteration's wall time into time inside the generation engine (its
shared-prefix forward and ``model.generate``) and everything else (noise, perturb, restore, update, reward functions, shaping, bookkeeping). Prints the ratio
``everything else / generation`` per iteration. Target (issue): <= 0.10 on SmolLM2-135M-Instruct with
32 prompts x 16 new tokens and population 8.

    python benchmarks/es_overhead.py                       # the embedded SmolLM2-135M-Instruct
    python benchmarks/es_overhead.py --model path/to/model --iterations 3
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import TrainerCallback
from transformers.utils import logging as hf_logging

from trl_es import ESConfig, ESTrainer
from trl_es.models import load_model_and_tokenizer
from trl_es.tasks.arithmetic import arithmetic_reward, make_arithmetic_dataset


class _IterationTimer(TrainerCallback):
    def __init__(self):
        self.durations, self._start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.durations.append(time.perf_counter() - self._start)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Model id/path (default: the embedded SmolLM2-135M-Instruct).")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--population_size", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--noise_table_size", type=int, default=1 << 26, help="0 = fresh Gaussian noise per block.")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice).")
    parser.add_argument("--no_drift", action="store_true", help="Turn drift logging off (not the default).")
    cli = parser.parse_args()
    if cli.threads:
        torch.set_num_threads(cli.threads)
    hf_logging.set_verbosity_error()

    model, tokenizer = load_model_and_tokenizer(cli.model)
    dataset = make_arithmetic_dataset(cli.prompts * cli.iterations, seed=0)
    timer = _IterationTimer()
    args = ESConfig(
        output_dir=tempfile.mkdtemp(),
        max_steps=cli.iterations,
        population_size=cli.population_size,
        prompt_batch_size=cli.prompts,
        max_completion_length=cli.new_tokens,
        # never stop early at EOS, so every member generates exactly new_tokens tokens
        generation_kwargs={"min_new_tokens": cli.new_tokens},
        noise_table_size=cli.noise_table_size,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        log_parameter_drift=not cli.no_drift,  # the default a user gets: drift logged at every iteration
    )
    trainer = ESTrainer(model, arithmetic_reward, args=args, train_dataset=dataset, processing_class=tokenizer,
                        callbacks=[timer])
    # Time the whole generation path (the engine: shared-prefix forward + model.generate), one call per member.
    generate_seconds = []
    engine = trainer.generation_engine
    original_generate = engine._generate_ids

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original_generate(*args, **kwargs)
        finally:
            generate_seconds.append(time.perf_counter() - start)

    engine._generate_ids = timed_generate
    trainer.train()

    print(f"model: {cli.model or 'embedded SmolLM2-135M-Instruct'}, {sum(p.numel() for p in model.parameters()):,} "
          f"parameters; population {cli.population_size}, {cli.prompts} prompts x {cli.new_tokens} new tokens; "
          f"torch threads {torch.get_num_threads()}; noise_table_size {cli.noise_table_size}")
    per_iteration = cli.population_size
    ratios = []
    for i, total in enumerate(timer.durations):
        generation = sum(generate_seconds[i * per_iteration : (i + 1) * per_iteration])
        other = total - generation
        ratios.append(other / generation)
        print(f"iteration {i + 1}: total {total:.2f} s, generation {generation:.2f} s, everything else {other:.2f} s, "
              f"ratio {other / generation:.3f}")
    logs = [h for h in trainer.state.log_history if "time/perturb" in h]
    for key in ("time/perturb", "time/restore", "time/update"):
        print(f"  mean {key}: {sum(h[key] for h in logs) / len(logs):.3f} s per iteration")
    print(f"ratio (everything else / generation), mean over iterations: {sum(ratios) / len(ratios):.3f}")


if __name__ == "__main__":
    main()
