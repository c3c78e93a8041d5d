"""examples/studies/auto_sigma.py on the small Llama of pretrain_from_scratch.py: the transfer arms, the alpha picked
on validation, the collapse arms' folders."""

import json
import os

import pytest
from example_script import example_script


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama") / "run"
    with example_script("studies/pretrain_from_scratch.py", "pretrain_from_scratch") as script:
        script.main([
            "--output_dir", str(out), "--high", "6", "--num_validation_problems", "6", "--num_test_problems", "8",
            "--num_documents", "200", "--num_general_eval", "4", "--vocab_size", "300", "--hidden_size", "32",
            "--intermediate_size", "64", "--num_hidden_layers", "2", "--max_steps", "4", "--save_steps", "4",
            "--per_device_train_batch_size", "8", "--num_seen_problems", "4", "--eval_max_new_tokens", "4",
        ])
    return str(out)


def test_llama_transfer_arms_and_the_alpha_picked_on_validation(tiny_llama, tmp_path):
    out = str(tmp_path / "study")
    common = ["--setting", "llama", "--llama_dir", tiny_llama, "--llama_step", "4", "--llama_train_prompts", "20",
              "--max_steps", "2", "--output_dir", out,
              "--extra", "--population_size 4 --prompt_batch_size 2 --max_completion_length 4"]
    arms = ["auto", "sigma_0.005_lr0.01", "sigma_0.005_lr0.02"]
    with example_script("studies/auto_sigma.py", "auto_sigma") as script:
        script.main(["transfer", *common, "--seeds", "0", "--alphas", "0.01", "0.02", "--only", *arms])
        results = {}
        for arm in arms:
            with open(os.path.join(out, "llama", "seed0", arm, "results.json")) as f:
                results[arm] = json.load(f)
        for result in results.values():
            iterations = [h for h in result["log_history"] if "reward" in h]
            assert len(iterations) == 2
            assert all(0.0 <= result[k] <= 1.0 for k in ("validation_accuracy_after", "test_accuracy_after"))
        # the grid arms ran at their sigma and alpha; auto picked and logged its own sigma
        assert results["sigma_0.005_lr0.02"]["sigma"] == 0.005
        assert [h["learning_rate"] for h in results["sigma_0.005_lr0.02"]["log_history"] if "reward" in h][0] == \
            pytest.approx(2 * [h["learning_rate"] for h in results["sigma_0.005_lr0.01"]["log_history"]
                               if "reward" in h][0])
        auto_sigma = results["auto"]["sigma"]
        assert auto_sigma > 0 and auto_sigma == [h["sigma"] for h in results["auto"]["log_history"] if "sigma" in h][0]
        # a rerun keeps finished arms
        mtime = os.path.getmtime(os.path.join(out, "llama", "seed0", "auto", "results.json"))
        script.main(["transfer", *common, "--seeds", "0", "--only", "auto"])
        assert os.path.getmtime(os.path.join(out, "llama", "seed0", "auto", "results.json")) == mtime
        text = script.main(["summary", *common, "--alphas", "0.01", "0.02"])
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines()[2:]}
    assert set(rows) == {"auto", "sigma_0.005"}
    picked = max(["sigma_0.005_lr0.01", "sigma_0.005_lr0.02"],
                 key=lambda a: results[a]["validation_accuracy_after"])  # max keeps the first of a tie, as summary
    assert rows["sigma_0.005"][1] == picked.split("_lr")[1]
    assert rows["sigma_0.005"][4] == f"{results[picked]['test_accuracy_after']:.3f}"
    assert rows["auto"][1] == "recipe's" and rows["auto"][6].strip(" |") == f"{auto_sigma:.3g}"


def test_llama_step_that_is_not_a_checkpoint_is_refused(tiny_llama, tmp_path):
    with example_script("studies/auto_sigma.py", "auto_sigma") as script, \
            pytest.raises(ValueError, match="--llama_step 5 is not a checkpoint"):
        script.main(["transfer", "--setting", "llama", "--llama_dir", tiny_llama, "--llama_step", "5",
                     "--output_dir", str(tmp_path), "--only", "auto"])


def test_collapse_curves_mark_the_rollbacks(tmp_path):
    def write_log(arm, seed, rewards, rollbacks=None):
        folder = tmp_path / "collapse" / f"seed{seed}" / arm
        folder.mkdir(parents=True)
        lines = ["Sigma = 0.005"]
        for k, reward in enumerate(rewards):  # as trl-es train prints them, after tqdm's bar
            guard = f", 'es/rollbacks': '{rollbacks[k]}'" if rollbacks else ""
            lines.append(f" 4%|| 1/26 {{'loss': '{-reward}', 'reward': '{reward}'{guard}, 'epoch': '0.1'}}")
        (folder / "log.txt").write_text("\n".join(lines) + "\n")

    write_log("alpha_x10", 0, [0.31, 0.0, 0.0, 0.0, 0.0])
    write_log("alpha_x10_guard", 0, [0.31, 0.0, 0.0, 0.0, 0.5], rollbacks=[0, 0, 0, 1, 1])
    write_log("alpha_x10_guard", 1, [0.4, 0.1, 0.0, 0.0, 0.0, 0.6, 0.0], rollbacks=[0, 0, 0, 1, 1, 1, 2])
    with example_script("studies/auto_sigma.py", "auto_sigma") as script:
        found = script.main(["curves", "--output_dir", str(tmp_path)])
    assert found["seed0"]["alpha_x10"] == {"reward": [0.31, 0.0, 0.0, 0.0, 0.0], "rollbacks": []}
    assert found["seed0"]["alpha_x10_guard"]["rollbacks"] == [4]
    assert found["seed1"]["alpha_x10_guard"] == {"reward": [0.4, 0.1, 0.0, 0.0, 0.0, 0.6, 0.0], "rollbacks": [4, 7]}
    assert (tmp_path / "collapse_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_effect_on_a_trained_arms_weights(tiny_model_dir, tmp_path):
    """``effect --model``: the effect measured on another folder's weights (the same recipe, batch and probe members),
    written into that folder; without it, on the recipe's model, into the output folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_es import ESConfig, ESTrainer
    from trl_es.tasks.arithmetic import arithmetic_reward, make_arithmetic_dataset_dict

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\ntask: arithmetic\nnum_train_prompts: 8\n"
                      "num_validation_prompts: 4\nnum_eval_prompts: 4\npopulation_size: 4\nprompt_batch_size: 4\n"
                      "max_completion_length: 4\nnoise_table_size: 1048576\n")
    trained = str(tmp_path / "trained")  # a made-up trained arm: the tiny model, weights moved
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    model.save_pretrained(trained)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(trained)
    common = ["effect", "--recipe", str(recipe), "--sigmas", "0.01", "0.1", "--output_dir", str(tmp_path / "out")]
    with example_script("studies/auto_sigma.py", "auto_sigma") as script:
        base = script.main(common)
        moved = script.main([*common, "--model", trained])
    with open(os.path.join(trained, "effect.json")) as f:  # compared as text: a count with no row is NaN
        assert json.dumps(json.load(f)) == json.dumps(moved)
    with open(tmp_path / "out" / "effect_rank1.json") as f:
        assert json.dumps(json.load(f)) == json.dumps(base)
    assert base["model"] == tiny_model_dir and moved["model"] == trained
    # the same measure, made here on the trained weights and the run's first batch
    tokenizer = AutoTokenizer.from_pretrained(trained)
    splits = make_arithmetic_dataset_dict(8, 4, 4, seed=0, conversational=tokenizer.chat_template is not None)
    args = ESConfig(output_dir=str(tmp_path / "direct"), population_size=4, prompt_batch_size=4,
                    max_completion_length=4, noise_table_size=1 << 20, sigma="auto", report_to="none", seed=0)
    trainer = ESTrainer(AutoModelForCausalLM.from_pretrained(trained), [arithmetic_reward], args=args,
                        train_dataset=splits["train"], processing_class=tokenizer)
    assert trainer.measure_sigma_effect([0.01, 0.1])["effects"] == moved["effects"]
