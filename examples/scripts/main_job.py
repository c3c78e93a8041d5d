"""The README's main job: ES-train the embedded SmolLM2-135M-Instruct on the arithmetic task on a CPU.

Prints greedy held-out accuracy (200 prompts never used for fitness) before and after training, and writes the
trained model, the seed log (es_seed_log.jsonl), results.json and training_curves.png to runs/main_job.

    python examples/scripts/main_job.py                       # the recipe as is
    python examples/scripts/main_job.py --max_steps 4         # any ESConfig / task field overrides the recipe
"""

import os
import sys

from trl_es.cli import train

RECIPE = os.path.join(os.path.dirname(__file__), "..", "recipes", "arithmetic_smollm2.yaml")

if __name__ == "__main__":
    results = train(["--config", RECIPE, *sys.argv[1:]])
    print(f"held-out accuracy: {results.get('accuracy_before', float('nan')):.3f} -> {results['accuracy_after']:.3f}")
