"""The trl-es CLI end to end on a tiny model (two ES iterations), eval with its settings from the run, analyze."""

import json
import re
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from trl_es import ESConfig, ESTrainer, replay
from trl_es.cli import RUN_FILE, TaskArguments, main, read_run_settings, task_splits
from trl_es.rewards import last_number
from trl_es.tasks import get_task
from trl_es.tasks.arithmetic import arithmetic_reward

RECIPE = ("task: arithmetic\nnum_train_prompts: 8\nnum_validation_prompts: 4\nnum_eval_prompts: 5\n"
          "population_size: 4\nprompt_batch_size: 4\nmax_completion_length: 4\nsigma: 0.02\nlearning_rate: 0.02\n"
          "generation_kwargs: {repetition_penalty: 1.1}\n")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_model_dir):
    """One `trl-es train` run of two iterations, shared by the tests that read its outputs."""
    tmp_path = tmp_path_factory.mktemp("run")
    out, recipe = tmp_path / "run", tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    status = main(["train", "--config", str(recipe), "--model_name_or_path", tiny_model_dir, "--output_dir", str(out),
                   "--max_steps", "2", "--report_to", "none", "--save_strategy", "no",
                   "--noise_table_size", str(1 << 20), "--eval_strategy", "steps", "--eval_steps", "1",
                   "--top_p", "0.9"])
    assert status == 0
    return out, recipe


def test_train_two_iterations(trained_run, tiny_model_dir):
    out, _ = trained_run
    results = json.loads((out / "results.json").read_text())
    # A random tiny model never answers a + b: every accuracy is exactly 0, on both splits, before and after.
    assert results.pop("train_seconds") > 0
    assert results == {"task": "arithmetic", "eval_split": "validation", "num_train_prompts": 8,
                       "num_validation_prompts": 4, "num_test_prompts": 5, "accuracy_before": 0.0,
                       "test_accuracy_before": 0.0, "accuracy_after": 0.0, "iterations": 2, "max_steps": 2,
                       "stopped_by_time_budget": False,
                       "curve": [{"step": 1, "accuracy": 0.0}, {"step": 2, "accuracy": 0.0}],
                       "test_accuracy_after": 0.0}
    assert (out / "training_curves.png").stat().st_size > 1000
    records = [json.loads(line) for line in (out / "es_seed_log.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in records] == [1, 2]
    trained = AutoModelForCausalLM.from_pretrained(out)
    rebuilt = replay(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(out))
    for (name, a), b in zip(trained.state_dict().items(), rebuilt.state_dict().values()):
        assert torch.equal(a, b), name


def test_train_writes_the_run_settings(trained_run):
    out, _ = trained_run
    assert json.loads((out / RUN_FILE).read_text()) == {
        "task": "arithmetic", "task_seed": 0, "num_train_prompts": 8, "num_validation_prompts": 4,
        "num_eval_prompts": 5, "eval_split": "validation", "countdown_json": None, "max_completion_length": 4,
        "temperature": 0.0, "top_p": 0.9, "generation_kwargs": {"repetition_penalty": 1.1},
        "chat_template_kwargs": None,
    }


def test_eval_takes_its_settings_from_the_run(trained_run, tmp_path):
    out, recipe = trained_run
    output = tmp_path / "metrics.json"
    metrics = main_eval(["--model_name_or_path", str(out), "--output_file", str(output)])
    assert json.loads(output.read_text()) == metrics
    settings = {k: (v["value"], v["source"]) for k, v in metrics["settings"].items()}
    assert settings == {
        "task": ("arithmetic", "run"), "task_seed": (0, "run"), "num_train_prompts": (8, "run"),
        "num_validation_prompts": (4, "run"), "num_eval_prompts": (5, "run"), "countdown_json": (None, "run"),
        "max_new_tokens": (4, "run"), "sample_temperature": (0.6, "default"),  # greedy training: the papers' protocol
        "top_p": (0.95, "default"),  # the run's top_p never applied (greedy), so the protocol's
        "generation_kwargs": ({"repetition_penalty": 1.1}, "run"),
        "chat_template_kwargs": (None, "default"),
    }
    assert (metrics["split"], metrics["num_prompts"], metrics["max_new_tokens"], metrics["num_samples"]) == (
        "test", 5, 4, 1)
    assert metrics["accuracy_greedy"] == 0.0 and metrics["pass@1"] == 0.0
    assert metrics["greedy_rewards/arithmetic_reward/mean"] == 0.0
    assert metrics["sampled_rewards/arithmetic_reward/mean"] == 0.0
    # Flags win over the run; the validation split is the run's validation split.
    metrics = main_eval(["--model_name_or_path", str(out), "--max_new_tokens", "2", "--split", "validation",
                         "--num_eval_prompts", "3"])
    assert metrics["settings"]["max_new_tokens"] == {"value": 2, "source": "flag"}
    assert metrics["settings"]["num_eval_prompts"] == {"value": 3, "source": "flag"}
    assert (metrics["split"], metrics["num_prompts"]) == ("validation", 4)
    # A training recipe (ESConfig keys) is accepted by --config and wins over the run; unknown keys are an error.
    metrics = main_eval(["--config", str(recipe), "--model_name_or_path", str(out)])
    assert metrics["settings"]["max_new_tokens"] == {"value": 4, "source": "recipe"}
    assert metrics["settings"]["top_p"] == {"value": 0.95, "source": "default"}
    assert metrics["settings"]["task"] == {"value": "arithmetic", "source": "recipe"}
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_completion_length: 3\nno_such_key: 1\n")
    with pytest.raises(ValueError, match=r"\['no_such_key'\] are neither trl-es eval arguments nor ESConfig fields"):
        main_eval(["--config", str(bad), "--model_name_or_path", str(out)])


def main_eval(args):
    import trl_es.cli

    return trl_es.cli.evaluate(args)


def test_eval_pass_at_k(tmp_path, tiny_model_dir):
    output = tmp_path / "metrics.json"
    main(["eval", "--model_name_or_path", tiny_model_dir, "--task", "arithmetic", "--num_eval_prompts", "6",
          "--num_samples", "3", "--pass_k", "1", "3", "--max_new_tokens", "3", "--output_file", str(output)])
    metrics = json.loads(output.read_text())
    assert metrics["num_prompts"] == 6 and metrics["num_samples"] == 3 and metrics["sample_temperature"] == 0.6
    assert metrics["top_p"] == 0.95 and metrics["settings"]["top_p"] == {"value": 0.95, "source": "default"}
    assert metrics["settings"]["max_new_tokens"] == {"value": 3, "source": "flag"}
    # A random tiny model never answers a + b correctly.
    assert metrics["accuracy_greedy"] == 0.0 and metrics["pass@1"] == 0.0 and metrics["pass@3"] == 0.0
    # The sampled pass is evaluate_policy's (trl_es.analysis.sample_policy), seeded with the task seed: same entropy.
    from trl_es.analysis import evaluate_policy
    from trl_es.cli.eval_command import parse_eval_arguments
    from trl_es.cli.loading import load_model_and_tokenizer
    from trl_es.cli.splits import task_splits

    task_args, _, model_args, _ = parse_eval_arguments(["--model_name_or_path", tiny_model_dir, "--task",
                                                        "arithmetic", "--num_eval_prompts", "6"])
    task, splits = task_splits(task_args)
    model, tokenizer = load_model_and_tokenizer(model_args)
    report = evaluate_policy(model, tokenizer, [splits["test"][i] for i in range(6)], task.reward_funcs, 3,
                             num_samples=3, pass_k=(1, 3), temperature=0.6, top_p=0.95, seed=task_args.task_seed,
                             progress=False)
    assert 0 < metrics["token_entropy_tokens"] == report["token_entropy_tokens"] <= 6 * 3 * 3
    assert metrics["token_entropy"] == pytest.approx(report["token_entropy"], rel=1e-6)


def test_eval_rejects_k_above_samples(tiny_model_dir):
    with pytest.raises(ValueError, match="pass_k values must be <= num_samples"):
        main(["eval", "--model_name_or_path", tiny_model_dir, "--num_samples", "2", "--pass_k", "4"])
    with pytest.raises(ValueError, match="0 means one sample"):
        main(["eval", "--model_name_or_path", tiny_model_dir, "--pass_k", "2"])
    with pytest.raises(ValueError, match=r"^sample_temperature must be > 0 \(the sampled completions"):
        main(["eval", "--model_name_or_path", tiny_model_dir, "--sample_temperature", "0"])
    with pytest.raises(ValueError, match=r"argument --split: invalid choice: 'train'"):
        main(["eval", "--model_name_or_path", tiny_model_dir, "--split", "train"])
    with pytest.raises(ValueError, match=r"^sample_batch_size must be >= 1 \(or None: about 128 rows a call\), got 0"):
        main(["eval", "--model_name_or_path", tiny_model_dir, "--sample_batch_size", "0"])


def test_eval_reports_every_reward_function(tmp_path, tiny_model_dir):
    metrics = main_eval(["--model_name_or_path", tiny_model_dir, "--task", "countdown", "--num_eval_prompts", "2",
                         "--num_validation_prompts", "0", "--num_train_prompts", "1", "--max_new_tokens", "2"])
    assert metrics["greedy_rewards/countdown_format_reward/mean"] == 0.0
    assert metrics["greedy_rewards/countdown_answer_reward/mean"] == 0.0
    assert metrics["sampled_rewards/countdown_answer_reward/mean"] == 0.0 and metrics["num_prompts"] == 2


def _answer_then_ramble(tokenizer):
    """A stand-in for ``generate``: every prompt "What is a + b?" gets "a + b = <a+b>\\n56 - 44 = 12"."""

    def generate(self, input_ids=None, attention_mask=None, generation_config=None, **kwargs):
        completions = []
        for prompt in tokenizer.batch_decode(input_ids, skip_special_tokens=True):
            a, b = map(int, re.search(r"What is (-?\d+) \+ (-?\d+)\?", prompt).groups())
            text = f"{a} + {b} = {a + b}\n56 - 44 = 12"
            completions.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
        width = max(map(len, completions))
        padded = torch.tensor([ids + [tokenizer.eos_token_id] * (width - len(ids)) for ids in completions],
                              dtype=input_ids.dtype)
        for step in range(width):  # custom logits processors see one score row per step, as in generate
            scores = torch.zeros(len(padded), self.config.vocab_size)
            scores[torch.arange(len(padded)), padded[:, step]] = 10.0
            for processor in kwargs.get("logits_processor") or []:
                processor(torch.cat([input_ids, padded[:, :step]], dim=1), scores)
        return torch.cat([input_ids, padded], dim=1)

    return generate


def test_right_answer_then_a_wrong_number_scores_the_same_in_training_and_evaluation(
    tmp_path, tokenizer, tiny_model_dir, monkeypatch
):
    """A model that answers right and then adds a wrong number: ESTrainer.evaluate (what training logs) and
    `trl-es eval` use the same reward function and both score it 1.0 (the old last-number rule scored 0.0)."""
    monkeypatch.setattr(LlamaForCausalLM, "generate", _answer_then_ramble(tokenizer))
    task = get_task("arithmetic")
    assert task.reward_funcs == [arithmetic_reward]
    _, splits = task_splits(TaskArguments(num_train_prompts=4, num_validation_prompts=0, num_eval_prompts=5))
    args = ESConfig(output_dir=str(tmp_path / "es"), population_size=2, prompt_batch_size=2, max_steps=1,
                    max_completion_length=16, noise_table_size=1 << 20, report_to=[], save_strategy="no")
    trainer = ESTrainer(AutoModelForCausalLM.from_pretrained(tiny_model_dir), task.reward_funcs, args=args,
                        train_dataset=splits["train"], eval_dataset=splits["test"], processing_class=tokenizer)
    assert trainer.reward_scorer.reward_funcs == [arithmetic_reward]
    assert trainer.evaluate()["eval_rewards/arithmetic_reward/mean"] == 1.0
    metrics = main_eval(["--model_name_or_path", tiny_model_dir, "--num_train_prompts", "4",
                         "--num_validation_prompts", "0", "--num_eval_prompts", "5", "--max_new_tokens", "16"])
    assert metrics["accuracy_greedy"] == 1.0 and metrics["pass@1"] == 1.0
    assert metrics["greedy_rewards/arithmetic_reward/mean"] == 1.0 and metrics["num_prompts"] == 5
    assert last_number("47 + 35 = 82\n56 - 44 = 12") == 12  # what the old rule graded


def test_train_on_the_test_split(tmp_path, tiny_model_dir):
    results = main_train(["--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path), "--report_to", "none",
                          "--save_strategy", "no", "--max_steps", "1", "--population_size", "2",
                          "--prompt_batch_size", "2", "--max_completion_length", "2", "--noise_table_size",
                          str(1 << 20), "--num_train_prompts", "4", "--num_validation_prompts", "0",
                          "--num_eval_prompts", "3", "--eval_split", "test", "--plot", "false"])
    # The test split is the eval split: no separate test_accuracy_*.
    train_seconds = results.pop("train_seconds")
    assert isinstance(train_seconds, float) and train_seconds >= 0.0
    assert results == {"task": "arithmetic", "eval_split": "test", "num_train_prompts": 4,
                       "num_validation_prompts": 0, "num_test_prompts": 3, "accuracy_before": 0.0,
                       "accuracy_after": 0.0, "iterations": 1, "max_steps": 1, "stopped_by_time_budget": False,
                       "curve": [{"step": 1, "accuracy": 0.0}]}
    assert json.loads((tmp_path / RUN_FILE).read_text())["eval_split"] == "test"
    # A checkpoint folder reads its run's settings from the parent folder.
    (tmp_path / "checkpoint-1").mkdir()
    assert read_run_settings(str(tmp_path / "checkpoint-1"))["num_eval_prompts"] == 3
    assert read_run_settings(str(tmp_path / "elsewhere")) == {}


def test_train_stops_at_the_time_budget_on_a_held_out_point(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """--time_budget_minutes stops on trl_es.trainer.time_budget.TrainingClock after the first iteration past the
    budget, and that iteration is evaluated during training (the curve ends on it) although eval_steps=100 would not
    evaluate it."""
    evaluations, training = [], []
    train, evaluate = ESTrainer.train, ESTrainer.evaluate

    def recording_train(self, *args, **kwargs):
        training.append(True)
        try:
            return train(self, *args, **kwargs)
        finally:
            training.pop()

    def recording_evaluate(self, *args, **kwargs):
        evaluations.append((self.state.global_step, bool(training)))
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(ESTrainer, "train", recording_train)
    monkeypatch.setattr(ESTrainer, "evaluate", recording_evaluate)
    results = main_train(["--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path), "--report_to", "none",
                          "--save_strategy", "no", "--max_steps", "5", "--population_size", "2",
                          "--prompt_batch_size", "2", "--max_completion_length", "2", "--noise_table_size",
                          str(1 << 20), "--num_train_prompts", "4", "--num_validation_prompts", "2",
                          "--num_eval_prompts", "0", "--eval_strategy", "steps", "--eval_steps", "100",
                          "--eval_before_training", "false", "--plot", "false", "--time_budget_minutes", "1e-9"])
    assert results["iterations"] == 1 and results["curve"] == [{"step": 1, "accuracy": 0.0}]
    assert evaluations == [(1, True)]  # at the stop, inside training; not again after it
    # a cut run says so: in results.json, and in stdout
    assert (results["max_steps"], results["stopped_by_time_budget"], results["time_budget_minutes"]) == (5, True, 1e-9)
    with open(tmp_path / "results.json") as f:
        assert json.load(f)["stopped_by_time_budget"] is True
    printed = capsys.readouterr().out
    assert "WARNING: training was cut short by the time budget (1e-09 min): it stopped at iteration 1 of max_steps=5" \
        in printed


def test_train_to_max_steps_under_a_budget_is_not_cut(tmp_path, tiny_model_dir, capsys):
    """A budget that max_steps reaches first leaves the run whole: stopped_by_time_budget False, no warning."""
    results = main_train(["--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path), "--report_to", "none",
                          "--save_strategy", "no", "--max_steps", "2", "--population_size", "2",
                          "--prompt_batch_size", "2", "--max_completion_length", "2", "--noise_table_size",
                          str(1 << 20), "--num_train_prompts", "4", "--num_validation_prompts", "2",
                          "--num_eval_prompts", "0", "--eval_strategy", "no", "--eval_before_training", "false",
                          "--plot", "false", "--time_budget_minutes", "100"])
    assert (results["iterations"], results["max_steps"], results["stopped_by_time_budget"]) == (2, 2, False)
    assert "time_budget_minutes" not in results and "cut short" not in capsys.readouterr().out


def main_train(args):
    import trl_es.cli

    return trl_es.cli.train(args)


def test_train_errors(tmp_path, tiny_model_dir):
    base = ["train", "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path), "--report_to", "none"]
    with pytest.raises(ValueError, match="eval_split='validation' is empty: set --num_validation_prompts >= 1"):
        main([*base, "--num_validation_prompts", "0"])
    with pytest.raises(ValueError, match=r"argument --generation_kwargs.*must be a JSON object"):
        main([*base, "--generation_kwargs", "{repetition_penalty: 1.1}"])


@pytest.mark.parametrize("flags,yaml,named,suggested,parsed", [
    (["--dataset_name", "trl-lib/DeepMath-103K", "--reward_funcs", "accuracy_reward", "think_format_reward"], None,
     "--dataset_name, --reward_funcs",
     "--dataset_name trl-lib/DeepMath-103K --reward_funcs accuracy_reward think_format_reward",
     ("trl-lib/DeepMath-103K", ["accuracy_reward", "think_format_reward"], None)),
    (["--reward_model_name_or_path=my/rm"], None, "--reward_model_name_or_path", "--reward_model_name_or_path=my/rm",
     (None, None, "my/rm")),
    (["--dataset_config", "main"], "dataset_name: trl-lib/DeepMath-103K\nreward_funcs: [accuracy_reward]\n",
     "--dataset_config, --dataset_name, --reward_funcs", "--config {yaml} --dataset_config main",
     ("trl-lib/DeepMath-103K", ["accuracy_reward"], None)),
])
def test_train_points_dataset_and_reward_flags_to_the_es_script(tmp_path, flags, yaml, named, suggested, parsed):
    """--dataset_name, --reward_funcs, ... (flags or YAML keys) are the TRL-style script's: the error names them and
    gives the examples/scripts/es.py command, which that script's parser takes."""
    from example_script import example_script

    argv = ["--output_dir", str(tmp_path)]
    if yaml is not None:
        (tmp_path / "recipe.yaml").write_text(yaml)
        argv += ["--config", str(tmp_path / "recipe.yaml")]
    suggested = suggested.format(yaml=tmp_path / "recipe.yaml")
    with pytest.raises(ValueError, match=re.escape(
            f"trl-es train trains on a built-in task (--task countdown | arithmetic | gsm) and takes no {named}: a "
            "dataset with reward functions is trained by the TRL-style script (TRL's grpo.py with ESTrainer), e.g. "
            f"python examples/scripts/es.py {suggested} --output_dir <dir>")) as error:
        main(["train", *argv, *flags])
    command = str(error.value).split("e.g. python ")[1].split(" --output_dir <dir>")[0].split()
    assert command[0] == "examples/scripts/es.py"
    with example_script("scripts/es.py", "es_script_suggested") as script:
        script_args, _, _ = script.make_parser().parse_args_and_config([*command[1:], "--output_dir", str(tmp_path)])
    assert (script_args.dataset_name, script_args.reward_funcs, script_args.reward_model_name_or_path) == parsed


def test_train_still_refuses_other_unknown_flags_and_keys(tmp_path):
    with pytest.raises(ValueError, match=re.escape("not used by the HfArgumentParser: ['--bogus', '1']")):
        main(["train", "--output_dir", str(tmp_path), "--bogus", "1"])
    (tmp_path / "recipe.yaml").write_text("bogus_key: 1\n")
    with pytest.raises(ValueError, match=re.escape("Unknown arguments from config file: ['--bogus_key', '1']")):
        main(["train", "--output_dir", str(tmp_path), "--config", str(tmp_path / "recipe.yaml")])


def test_analyze_writes_report(tmp_path, tiny_model_dir):
    main(["analyze", "--base_model", tiny_model_dir, "--model_a", tiny_model_dir, "--task", "arithmetic",
          "--num_eval_prompts", "4", "--num_train_prompts", "4", "--num_kl_prompts", "2", "--max_new_tokens", "3",
          "--analysis_dir", str(tmp_path / "analysis")])
    report = json.loads((tmp_path / "analysis" / "report.json").read_text())
    assert report["drift"]["a"]["l2"] == 0.0  # the checkpoint is the base model itself


@pytest.mark.parametrize("task", ["arithmetic", "countdown"])
def test_splits_are_disjoint(task):
    args = TaskArguments(task=task, num_train_prompts=50, num_validation_prompts=20, num_eval_prompts=30)
    _, splits = task_splits(args)
    assert list(splits) == ["train", "validation", "test"] and [len(splits[k]) for k in splits] == [50, 20, 30]
    prompts = {k: {json.dumps(p) for p in splits[k]["prompt"]} for k in splits}
    assert [len(prompts[k]) for k in splits] == [50, 20, 30]
    assert not prompts["train"] & prompts["validation"] and not prompts["train"] & prompts["test"]
    assert not prompts["validation"] & prompts["test"]
    # Test first: it does not change with the train or validation sizes.
    _, other = task_splits(TaskArguments(task=task, num_train_prompts=5, num_validation_prompts=0, num_eval_prompts=30))
    assert other["test"]["prompt"] == splits["test"]["prompt"] and len(other["validation"]) == 0


def test_task_arguments_validation():
    with pytest.raises(ValueError, match=r"eval_split must be one of \('validation', 'test'\), got 'train'"):
        TaskArguments(eval_split="train")
    with pytest.raises(ValueError, match="num_validation_prompts must be an integer >= 0, got -1"):
        TaskArguments(num_validation_prompts=-1)
    with pytest.raises(ValueError, match=r"time_budget_minutes must be >= 0 \(0 or unset: no budget\), got -1"):
        TaskArguments(time_budget_minutes=-1.0)


def test_console_script_help(warm_python):
    result = warm_python.run(["-m", "trl_es.cli", "--help"], cwd=os.getcwd())  # `python -m`, libraries imported
    assert result.returncode == 0 and "trl-es" in result.stdout and "train" in result.stdout


def test_eval_samples_as_a_sampled_run_trained(tmp_path):
    """A run trained with sampling: its temperature and top_p are the eval's; a greedy run's top_p is not."""
    from trl_es.cli.eval_command import parse_eval_arguments

    for temperature, expected in ((0.8, {"sample_temperature": (0.8, "run"), "top_p": (0.9, "run")}),
                                  (0.0, {"sample_temperature": (0.6, "default"), "top_p": (0.95, "default")})):
        run = tmp_path / f"t{temperature}"
        run.mkdir()
        (run / RUN_FILE).write_text(json.dumps({"task": "arithmetic", "temperature": temperature, "top_p": 0.9}))
        *_, settings = parse_eval_arguments(["--model_name_or_path", str(run)])
        assert {k: (settings[k]["value"], settings[k]["source"]) for k in expected} == expected
