"""What preemption-proofing costs: the seconds and bytes of one ES checkpoint, and of a seed-log-only record.

An ES run's state is the base weights plus the seed log, so there are two ways to survive a kill:

- a Trainer checkpoint every ``save_steps`` iterations (``checkpoint-N``: the model, the ES state — the fp32 master
  when the model is 16-bit, theta_0 when ``log_parameter_drift`` or ``awd_lambda`` keep one —, the seed log, the
  scheduler, RNG and trainer state), which ``resume_from_checkpoint="latest"`` resumes from;
- the seed log alone (``es_seed_log.jsonl``: one JSON record per iteration), from which :func:`trl_es.replay`
  rebuilds the weights from the base model (replay costs one update per logged iteration, not measured here).

This runs a few ES iterations (population 2, one prompt, one new token: the iterations themselves are not what is
measured) with ``save_steps=1`` and times every ``Trainer._save_checkpoint`` call (each checkpoint written to
``output_dir``, fsynced files included), then sums each checkpoint's bytes by file; and times rewriting the seed log
(``SeedLog.save``: the whole file to a temporary file, fsync, rename) and measures one record's bytes. Prints JSON
(``--output_json``: also to a file).

    python benchmarks/checkpoint_cost.py                            # the embedded SmolLM2-135M-Instruct, fp32
    python benchmarks/checkpoint_cost.py --dtype bfloat16           # bf16 model + fp32 master
    python benchmarks/checkpoint_cost.py --model path/to/model --iterations 3 --output_dir /fast/disk/tmp

The numbers depend on the disk (``--output_dir``; the default is a temporary folder) and its page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from datasets import Dataset
from transformers import PrinterCallback
from transformers.utils import logging as hf_logging

from trl_es import ESConfig, ESTrainer
from trl_es.es.seedlog import SEED_LOG_NAME
from trl_es.models import load_model_and_tokenizer


def constant_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def folder_bytes(folder: str) -> dict[str, int]:
    return {name: os.path.getsize(os.path.join(folder, name)) for name in sorted(os.listdir(folder))}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Model id/path (default: the embedded SmolLM2-135M-Instruct).")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--iterations", type=int, default=3, help="Iterations, each followed by a checkpoint.")
    parser.add_argument("--no_drift", action="store_true",
                        help="log_parameter_drift=False: no theta_0 (es_anchor.safetensors) in the checkpoints.")
    parser.add_argument("--output_dir", default=None, help="Where the checkpoints go (default: a temporary folder).")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output_json", default=None, help="Also write the JSON to this file.")
    cli = parser.parse_args(argv)
    if cli.threads:
        torch.set_num_threads(cli.threads)
    hf_logging.set_verbosity_error()

    model, tokenizer = load_model_and_tokenizer(cli.model, dtype=getattr(torch, cli.dtype))
    output_dir = cli.output_dir or tempfile.mkdtemp(prefix="checkpoint_cost_")
    args = ESConfig(
        output_dir=output_dir,
        max_steps=cli.iterations,
        population_size=2,
        prompt_batch_size=1,
        max_completion_length=1,
        save_strategy="steps",
        save_steps=1,
        log_parameter_drift=not cli.no_drift,
        report_to=[],
        disable_tqdm=True,
        noise_table_size=1 << 20,
        seed=0,
    )
    dataset = Dataset.from_dict({"prompt": [f"Say {i}:" for i in range(cli.iterations)]})
    trainer = ESTrainer(model, constant_reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)  # stdout: the JSON only

    seconds = []
    save_checkpoint = trainer._save_checkpoint

    def timed_save_checkpoint(*a, **k):
        start = time.perf_counter()
        try:
            return save_checkpoint(*a, **k)
        finally:
            seconds.append(time.perf_counter() - start)

    trainer._save_checkpoint = timed_save_checkpoint
    trainer.train()

    last = os.path.join(output_dir, f"checkpoint-{cli.iterations}")
    files = folder_bytes(last)
    es_state = {n: b for n, b in files.items() if n.startswith(("es_master", "es_anchor"))}
    model_bytes = {n: b for n, b in files.items() if n.startswith("model") and n.endswith((".safetensors", ".json"))}

    # The seed log alone: one record per iteration; SeedLog.save rewrites the file atomically (tmp, fsync, rename).
    log_path = os.path.join(output_dir, SEED_LOG_NAME)
    record_bytes = [len(json.dumps(r)) + 1 for r in trainer.seed_log.records]
    repeats = 20
    start = time.perf_counter()
    for _ in range(repeats):
        trainer.seed_log.save(log_path)
    log_seconds = (time.perf_counter() - start) / repeats

    result = {
        "model": cli.model or "embedded SmolLM2-135M-Instruct",
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "dtype": cli.dtype,
        "log_parameter_drift": not cli.no_drift,
        "output_dir": output_dir,
        "checkpoint": {
            "seconds_each": [round(s, 4) for s in seconds],
            "seconds_mean": round(sum(seconds) / len(seconds), 4),
            "bytes": sum(files.values()),
            "model_bytes": sum(model_bytes.values()),
            "es_state_bytes": sum(es_state.values()),
            "seed_log_bytes": files.get(SEED_LOG_NAME, 0),
            "other_bytes": sum(files.values()) - sum(model_bytes.values()) - sum(es_state.values())
            - files.get(SEED_LOG_NAME, 0),
            "files": files,
        },
        "seed_log_only": {
            "bytes_per_iteration": round(sum(record_bytes) / len(record_bytes), 1),
            "header_bytes": os.path.getsize(log_path) - sum(record_bytes),
            "seconds_to_write_log": round(log_seconds, 6),
            "iterations_in_log": len(record_bytes),
        },
    }
    print(json.dumps(result, indent=2))
    if cli.output_json:
        with open(cli.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
