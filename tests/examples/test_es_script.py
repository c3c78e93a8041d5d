"""examples/scripts/es.py: the copyable ESTrainer script, end to end as `python es.py` on a tiny local model."""

import os

import pytest
import torch
from example_script import SCRIPTS, example_script
from transformers import AutoModelForCausalLM

from trl_es import replay
from trl_es.es.seedlog import SeedLog

SCRIPT = os.path.join(SCRIPTS, "es.py")

# A reward a random tiny model's completions vary under (the arithmetic reward scores them all 0: no ES step)
REWARD_MODULE = '''
def length_reward(completions, **kwargs):
    from trl_es.rewards import completion_text

    return [float(sum(map(ord, completion_text(c))) % 7) for c in completions]
'''


def test_es_script_trains_saves_and_logs_one_iteration(tmp_path, tiny_model_dir, warm_python):
    """``python es.py ...`` as a child of the worker's warm interpreter (tests/warm_python.py: ``__main__``, argv,
    working directory, environment and exit code as a fresh ``python``; the libraries already imported)."""
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = warm_python.run(
        [SCRIPT, "--model_name_or_path", tiny_model_dir, "--output_dir", str(out),
         "--reward_funcs", "arithmetic_reward", "my_rewards.length_reward", "--max_steps", "1",
         "--population_size", "4", "--prompt_batch_size", "2", "--max_completion_length", "4",
         "--num_train_prompts", "8", "--num_test_prompts", "4", "--noise_table_size", str(1 << 20),
         "--sigma", "0.1", "--learning_rate", "0.05", "--report_to", "none", "--save_strategy", "no"],
        cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"Model saved to {out}." in proc.stdout
    for name in ("config.json", "model.safetensors", "tokenizer.json", "es_seed_log.jsonl"):
        assert (out / name).is_file(), name
    log = SeedLog.load(str(out))
    assert [r["step"] for r in log.records] == [1]  # exactly --max_steps iterations
    assert len(log.records[0]["members"]) == 4
    assert any(c != 0 for c in log.records[0]["coefficients"])  # the members' fitness differed
    base, trained = AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoModelForCausalLM.from_pretrained(out)
    moved = [n for (n, a), b in zip(base.state_dict().items(), trained.state_dict().values()) if not torch.equal(a, b)]
    assert moved  # the ES step changed the weights
    rebuilt = replay(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(out))
    for (name, a), b in zip(trained.state_dict().items(), rebuilt.state_dict().values()):
        assert torch.equal(a, b), name  # the saved model is the base model plus its seed log


def test_es_script_help_lists_the_script_es_and_model_flags(capsys):
    with example_script("scripts/es.py", "es_script_help") as module:
        with pytest.raises(SystemExit) as exit_info:
            module.make_parser().parse_args_and_config(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--reward_funcs", "--dataset_name", "--population_size", "--sigma", "--model_name_or_path",
                 "--use_peft"):
        assert flag in text, flag


def test_es_script_refuses_an_unknown_reward_name():
    with example_script("scripts/es.py", "es_script_rewards") as module:
        assert module.reward_function("arithmetic_reward") is module.REWARD_FUNCS["arithmetic_reward"]
        with pytest.raises(ValueError, match="unknown reward function 'no_such_reward'"):
            module.reward_function("no_such_reward")
