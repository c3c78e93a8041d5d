"""Write the reference runs of ``tests/es/test_training_matches_recorded_runs.py``: tiny ES runs, one folder per run with the base and
trained weights, the seed log and the run's ESConfig arguments. Re-running this script on a later ESTrainer must
reproduce them bitwise, on any x86-64 CPU (the ES runs; the AdamW run's optimizer kernels are CPU-dependent).

The base weights are data: written once by ``build_llama`` (commit fef91fa, 2026-12-01; torch's initialisation is
not the same on every CPU) and read from ``base.safetensors`` ever since. The trained weights and seed logs were
recorded again on 2026-12-02 with the portable noise and arithmetic (``trl_es.es.perturbation``; the records of
fef91fa used ``torch.randn`` noise and fused kernels, which only an AVX2 CPU reproduced).

    python tests/data/recorded_runs/make_runs.py      # from the repository root
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tiny import build_llama, build_tokenizer  # noqa: E402

from trl_es import ESConfig, ESTrainer  # noqa: E402

#: name -> ESConfig arguments beyond the common ones
RUNS = {
    "sequential_awd_antithetic": {"awd_lambda": 2.0, "antithetic": True, "population_size": 4},
    "lowrank_rank2": {"population_backend": "batched_lowrank", "noise_rank": 2, "population_size": 6,
                      "member_chunk_size": 4},
    "sequential_sampled": {"temperature": 1.0, "top_p": 0.9, "num_generations": 2, "population_size": 4},
    "torch_adamw": {"es_optimizer": "torch", "optim": "adamw_torch", "population_size": 4},
}
COMMON = {"max_steps": 3, "prompt_batch_size": 4, "max_completion_length": 6, "sigma": 0.02, "learning_rate": 0.02,
          "report_to": [], "save_strategy": "no", "noise_table_size": 1 << 20, "disable_tqdm": True, "seed": 0}


def prompts():
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Write: {i}"}] for i in range(8)],
                              "answer": [str(i) for i in range(8)]})


def mean_code(completions, answer, **kwargs):
    """Mean character code / 128, plus 1 if the completion contains the row's answer."""
    texts = [c[0]["content"] for c in completions]
    return [sum(map(ord, t)) / (128 * max(1, len(t))) + (a in t) for t, a in zip(texts, answer)]


def train(name: str, output_dir: str) -> tuple[dict, dict]:
    """Train run ``name``; returns (base state dict, trained state dict)."""
    tokenizer = build_tokenizer()
    model = build_llama(tokenizer, seed=0)
    recorded = os.path.join(HERE, name, "base.safetensors")
    if os.path.isfile(recorded):  # the base is data (torch's initialisation differs between CPUs)
        model.load_state_dict(load_file(recorded))
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    args = ESConfig(output_dir=output_dir, **COMMON, **RUNS[name])
    torch.manual_seed(0)
    trainer = ESTrainer(model, mean_code, args=args, train_dataset=prompts(), processing_class=tokenizer)
    trainer.train()
    trained = {k: v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()}
    return base, trained


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in RUNS:
        folder = os.path.join(HERE, name)
        base, trained = train(name, folder)
        save_file({k: v.contiguous() for k, v in base.items()}, os.path.join(folder, "base.safetensors"))
        save_file({k: v.contiguous() for k, v in trained.items()}, os.path.join(folder, "trained.safetensors"))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({**COMMON, **RUNS[name]}, f, indent=2)
        for extra in os.listdir(folder):
            if extra not in ("base.safetensors", "trained.safetensors", "config.json", "es_seed_log.jsonl"):
                path = os.path.join(folder, extra)
                if os.path.isfile(path):
                    os.remove(path)
        print(name, "written")
