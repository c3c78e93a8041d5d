"""The README's main job: ES-train the embedded SmolLM2-135M-Instruct on the arithmetic task on a CPU.

Prints greedy accuracy on the 200 test prompts (never used for fitness or tuning) before and after training, and
writes the trained model, the seed log (es_seed_log.jsonl), results.json and training_curves.png to runs/main_job.
The evaluations during training read the validation split. ``scripts/run_main_job.sh`` starts this script the
fastest way the machine allows (``python -m trl_es.launch``: one single-threaded process per physical core).

    python -m trl_es.launch examples/scripts/main_job.py          # what scripts/run_main_job.sh runs
    python examples/scripts/main_job.py --max_steps 4             # one process; any ESConfig / task field overrides
"""

import os
import sys

from trl_es.cli import train
from trl_es.files import is_main_process

RECIPE = os.path.join(os.path.dirname(__file__), "..", "recipes", "arithmetic_smollm2.yaml")

if __name__ == "__main__":
    results = train(["--config", RECIPE, *sys.argv[1:]])
    if is_main_process():
        before, after = results.get("test_accuracy_before"), results.get("test_accuracy_after")
        iterations = f"after {results['iterations']} of {results['max_steps']} iterations"
        if results["stopped_by_time_budget"]:
            iterations += f" (CUT SHORT by time_budget_minutes={results['time_budget_minutes']:g})"
        if after is not None:
            print(f"test accuracy: {before if before is not None else float('nan'):.3f} -> {after:.3f} {iterations}")
        print(f"{results['eval_split']} accuracy: {results.get('accuracy_before', float('nan')):.3f} -> "
              f"{results['accuracy_after']:.3f} {iterations}")
