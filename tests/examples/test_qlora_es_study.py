"""examples/studies/qlora_es.py (issue 60's learning study): the commands each arm runs, the sigma the 4-bit arm
takes from the lora arms' validation accuracy, and the table over seeds. Nothing trains here (the runs are
``trl-es train`` / ``trl-es eval`` commands, each tested on its own)."""

import json

import pytest

STUDY = "qlora_es"


def commands(study, capsys, *argv):
    study.main(["--dry_run", *argv])
    return [line.split() for line in capsys.readouterr().out.splitlines() if "trl_es.cli" in line
            or "--grpo_worker" in line]


def test_each_arm_runs_the_recipe_with_its_flags(study, capsys, tmp_path):
    lines = commands(study, capsys, "--output_dir", str(tmp_path), "--seeds", "3", "--adapter_sigmas", "0.02",
                     "0.05", "--adapter_sigma", "0.05", "--max_steps", "6")
    train = [c for c in lines if "train" in c]
    assert [c[c.index("--output_dir") + 1].split("/")[-2] for c in train] == [
        "full", "lora_sigma0.02", "lora_sigma0.05", "lora4bit_sigma0.05"]
    for command in train:
        assert command[command.index("--seed") + 1] == "3" and command[command.index("--max_steps") + 1] == "6"
    full, lora, _, four_bit = train
    assert "--use_peft" in lora and "--load_in_4bit" not in lora
    assert lora[lora.index("--sigma") + 1] == "0.02" and lora[lora.index("--learning_rate") + 1] == "0.04"
    assert "--use_peft" in four_bit and "--load_in_4bit" in four_bit
    assert "--use_peft" not in full and "--sigma" not in full  # the main job's recipe as it is
    worker = next(c for c in lines if "--grpo_worker" in c)
    spec = json.loads(" ".join(worker[worker.index("--grpo_worker") + 1:]))
    assert spec["seed"] == 3 and spec["lora_r"] == 16


@pytest.mark.parametrize(("accuracies", "picked"), [({0.02: 0.4, 0.05: 0.5}, 0.05), ({0.02: 0.5, 0.05: 0.5}, 0.02)])
def test_the_4bit_arm_takes_the_sigma_with_the_best_validation_accuracy(study, tmp_path, accuracies, picked):
    for sigma, accuracy in accuracies.items():
        run = tmp_path / f"lora_sigma{sigma:g}" / "seed0"
        run.mkdir(parents=True)
        (run / "results.json").write_text(json.dumps({"accuracy_after": accuracy}))
    args = study.parse_args(["--output_dir", str(tmp_path), "--seeds", "0", "--adapter_sigmas", "0.02", "0.05"])
    assert study.best_adapter_sigma(args, 0) == picked  # ties: the smaller sigma


def test_table_is_mean_and_spread_over_the_finished_seeds(study, tmp_path):
    for seed, (accuracy, pass4) in enumerate([(0.2, 0.5), (0.4, 0.7)]):
        run = tmp_path / "full" / f"seed{seed}"
        run.mkdir(parents=True)
        (run / "results.json").write_text(json.dumps({"iterations": 6, "train_seconds": 120.0,
                                                      "accuracy_after": 0.5 + seed / 10}))
        (run / "test_eval.json").write_text(json.dumps({"accuracy_greedy": accuracy, "pass@1": 0.3, "pass@4": pass4}))
    (tmp_path / "lora4bit_sigma0.02" / "seed0").mkdir(parents=True)  # unfinished: not in the table
    args = study.parse_args(["--output_dir", str(tmp_path), "--seeds", "0", "1", "2"])
    rows = study.table(args).splitlines()
    assert len(rows) == 3 and rows[2].startswith("| full | 2 | 0.550 ± 0.071 | 0.300 ± 0.141 | 0.200, 0.400 | ")
    assert "0.600 ± " in rows[2] and rows[2].endswith("| [6, 6] | 2.0 |")
    (tmp_path / "grpo_qlora" / "seed0").mkdir(parents=True)  # GRPO: no validation accuracy
    (tmp_path / "grpo_qlora" / "seed0" / "results.json").write_text(json.dumps({"steps": 9, "train_seconds": 60.0}))
    (tmp_path / "grpo_qlora" / "seed0" / "test_eval.json").write_text(
        json.dumps({"accuracy_greedy": 0.25, "pass@1": 0.2, "pass@4": 0.4}))
    study.main(["--output_dir", str(tmp_path), "--seeds", "0", "1", "--report"])  # runs nothing, writes the table
    rows = (tmp_path / "results.md").read_text().splitlines()
    assert rows[2].startswith("| full | 2 |")
    assert rows[3] == "| grpo_qlora | 1 | - | 0.250 ± 0.000 | 0.250 | 0.200 ± 0.000 | 0.400 ± 0.000 | [9] | 1.0 |"
