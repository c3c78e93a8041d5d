"""Trainer paths that load weights or resume state keep the ES state in step (issue 32, classes 2-5).

- load_best_model_at_end, model_init / hyper-parameter trials: the master, anchor and seed log follow the weights;
- resuming with other settings: refused by name where replay or the resumed run reads them;
- incomplete checkpoints and seed logs with missing steps: refused, naming what is missing;
- streams and map-style datasets resumed in any pass read the prompts of the uninterrupted run.
"""

import copy
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from test_es_trainer import assert_bitwise, es_args, mean_code, prompts, snapshot
from tiny import build_llama
from transformers import AutoModelForCausalLM

from trl_es import ESTrainer, replay
from trl_es.es import SEED_LOG_NAME, SeedLog
from trl_es.trainer.es.es_checkpoint import ANCHOR_WEIGHTS_NAME, MASTER_WEIGHTS_NAME


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models: one intra-op thread is faster (and leaves the other cores to other jobs)."""


class RowsPerStep:
    """mean_code, recording the distinct training prompts of every ES iteration (keyed by the iteration, 1-based)."""

    __name__ = "mean_code"

    def __init__(self):
        self.rows = {}

    def __call__(self, prompts, completions, trainer_state, **kwargs):
        step = trainer_state.global_step + 1
        seen = self.rows.setdefault(step, [])
        for prompt in prompts:
            if prompt not in seen:
                seen.append(prompt)
        return mean_code(completions)


def steps(folder):
    with open(os.path.join(folder, SEED_LOG_NAME)) as f:
        return [json.loads(line)["step"] for line in f.readlines()[1:]]


def model_file(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


# ---------------------------------------------------------------------------------------------- class 5: data order
def uninterrupted_and_resumed(tmp_path, tokenizer, data, max_steps, resume_at, **kwargs):
    """The uninterrupted run (which saves a checkpoint at ``resume_at``) and a run resumed from that checkpoint: the
    rows each read per iteration, and both trainers."""
    full_rows, resumed_rows = RowsPerStep(), RowsPerStep()
    kwargs = dict(max_steps=max_steps, prompt_batch_size=2, population_size=2, max_completion_length=3, **kwargs)
    args = es_args(tmp_path / "full", save_strategy="steps", save_steps=resume_at, **kwargs)
    full = ESTrainer(build_llama(tokenizer), full_rows, args=args, train_dataset=data(), processing_class=tokenizer)
    full.train()
    resumed = ESTrainer(build_llama(tokenizer), resumed_rows, train_dataset=data(), processing_class=tokenizer,
                        args=es_args(tmp_path / "resumed", **kwargs))
    resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, f"checkpoint-{resume_at}"))
    return full_rows.rows, resumed_rows.rows, full, resumed


def rows(*indices):
    return [f"Write: {i}" for i in indices]


def test_unshuffled_stream_resumed_in_its_second_pass_reads_the_same_rows(tmp_path, tokenizer):
    """6 rows, 2 a step, 6 steps: the second pass starts at step 4; resumed at step 4, steps 5-6 read rows 2-5."""
    full, resumed, full_trainer, resumed_trainer = uninterrupted_and_resumed(
        tmp_path, tokenizer, lambda: prompts(6).to_iterable_dataset(), max_steps=6, resume_at=4)
    assert full == {1: rows(0, 1), 2: rows(2, 3), 3: rows(4, 5), 4: rows(0, 1), 5: rows(2, 3), 6: rows(4, 5)}
    assert resumed == {5: rows(2, 3), 6: rows(4, 5)}
    assert_bitwise(snapshot(resumed_trainer.model), snapshot(full_trainer.model))
    assert [r["step"] for r in resumed_trainer.seed_log.records] == [1, 2, 3, 4, 5, 6]


def test_stream_batches_span_the_end_of_a_pass_and_resume_there(tmp_path, tokenizer):
    """7 rows, 2 a step: the passes are one sequence of rows (step 4 reads row 6 and row 0), resumed at step 3."""
    full, resumed, full_trainer, resumed_trainer = uninterrupted_and_resumed(
        tmp_path, tokenizer, lambda: prompts(7).to_iterable_dataset(), max_steps=6, resume_at=3)
    assert full == {1: rows(0, 1), 2: rows(2, 3), 3: rows(4, 5), 4: rows(6, 0), 5: rows(1, 2), 6: rows(3, 4)}
    assert resumed == {4: rows(6, 0), 5: rows(1, 2), 6: rows(3, 4)}
    assert_bitwise(snapshot(resumed_trainer.model), snapshot(full_trainer.model))


def test_shuffled_stream_resumed_in_its_second_pass_reads_the_same_rows(tmp_path, tokenizer):
    """A stream shuffled with a seed (2 shards, a buffer) is reshuffled for its second pass (set_epoch); resumed at
    step 5, steps 5-6 read what the uninterrupted run read."""
    def data():
        return prompts(6).to_iterable_dataset(num_shards=2).shuffle(seed=3, buffer_size=4)

    full, resumed, full_trainer, resumed_trainer = uninterrupted_and_resumed(tmp_path, tokenizer, data, max_steps=6,
                                                                             resume_at=5)
    first_pass = [r for s in (1, 2, 3) for r in full[s]]
    second_pass = [r for s in (4, 5, 6) for r in full[s]]
    assert sorted(first_pass) == sorted(second_pass) == rows(*range(6))  # each pass reads every row once
    assert first_pass != second_pass  # in another order: the stream was reshuffled
    assert resumed == {6: full[6]}
    assert_bitwise(snapshot(resumed_trainer.model), snapshot(full_trainer.model))


@pytest.mark.parametrize("strategy", ["random", "sequential"])
def test_map_style_dataset_resumed_in_its_second_epoch_reads_the_same_rows(tmp_path, tokenizer, strategy):
    full, resumed, full_trainer, resumed_trainer = uninterrupted_and_resumed(
        tmp_path, tokenizer, lambda: prompts(6), max_steps=6, resume_at=4, train_sampling_strategy=strategy)
    assert resumed == {5: full[5], 6: full[6]}
    assert sorted(r for s in (4, 5, 6) for r in full[s]) == rows(*range(6))  # steps 4-6: the second epoch
    if strategy == "sequential":
        assert full[5] == rows(2, 3) and full[6] == rows(4, 5)
    assert_bitwise(snapshot(resumed_trainer.model), snapshot(full_trainer.model))


# ---------------------------------------------------------------------------------------------- class 3: settings
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    """checkpoint-2 of a 4-step run with AWD (l2) and the torch SGD optimizer off (es_optimizer="es", optim="sgd"),
    and the uninterrupted run's final weights."""
    tmp_path = tmp_path_factory.mktemp("settings")
    args = es_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, awd_lambda=1.0, awd_penalty="l2",
                   optim="sgd")
    trainer = ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=prompts(),
                        processing_class=tokenizer)
    trainer.train()
    return os.path.join(args.output_dir, "checkpoint-2"), snapshot(trainer.model)


BASE = dict(max_steps=4, awd_lambda=1.0, awd_penalty="l2", optim="sgd")


@pytest.mark.parametrize(
    "changes, field, theirs, ours",
    [
        ({"awd_penalty": "l1"}, "awd_penalty", "'l2'", "'l1'"),
        ({"awd_lambda": 2.0}, "awd_lambda", "1.0", "2.0"),
        ({"es_optimizer": "torch"}, "es_optimizer", "'es'", "'torch'"),
        ({"population_size": 6}, "population_size", "4", "6"),
        ({"antithetic": True}, "antithetic", "False", "True"),
        ({"fitness_shaping": "centered_rank"}, "fitness_shaping", "'zscore'", "'centered_rank'"),
        ({"sigma": 0.03}, "sigma", "0.02", "0.03"),
        ({"seed": 1}, "seed", "0", "1"),
        ({"learning_rate": 0.01}, "learning_rate", "0.02", "0.01"),
        ({"lr_scheduler_type": "linear"}, "lr_scheduler_type", "'constant'", "'linear'"),
        ({"prompt_batch_size": 2}, "prompt_batch_size", "4", "2"),
        ({"temperature": 0.7}, "temperature", "0.0", "0.7"),
        ({"max_completion_length": 5}, "max_completion_length", "6", "5"),
        ({"per_prompt_shaping": "center"}, "per_prompt_shaping", "'none'", "'center'"),
        ({"noise_table_size": 0}, "noise_source/noise_table_size", "{", "{"),
        ({"include_parameters": "lm_head"}, "include_parameters/exclude_parameters (the trained parameters)", "[[",
         "[["),
        ({"population_backend": "batched_lowrank"}, "population_backend/noise_rank", "{'type': 'gaussian'}",
         "{'type': 'lowrank', 'rank': 1}"),
    ],
    ids=lambda v: v if isinstance(v, str) and v.isidentifier() else None,
)
def test_resume_with_another_setting_is_refused_by_name(tmp_path, tokenizer, checkpoint, changes, field, theirs,
                                                        ours):
    folder, _ = checkpoint
    args = es_args(tmp_path, **{**BASE, **changes})
    trainer = ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=prompts(),
                        processing_class=tokenizer)
    with pytest.raises(ValueError) as error:
        trainer.train(resume_from_checkpoint=folder)
    message = str(error.value)
    assert "settings differ from the checkpoint's" in message and f"{field} (checkpoint: {theirs}" in message, message
    assert f", this run: {ours}" in message.split(f"{field} (checkpoint: ")[1]
    assert trainer.state.global_step == 0 and trainer.seed_log.records == []  # refused before anything was loaded


def test_resume_with_other_reward_functions_is_refused(tmp_path, tokenizer, checkpoint):
    def share_b(completions, **kwargs):
        return [0.0 for _ in completions]

    trainer = ESTrainer(build_llama(tokenizer), share_b, args=es_args(tmp_path, **BASE), train_dataset=prompts(),
                        processing_class=tokenizer)
    with pytest.raises(ValueError, match=r"reward_funcs \(checkpoint: \['mean_code'\], this run: \['share_b'\]\)"):
        trainer.train(resume_from_checkpoint=checkpoint[0])


def test_resume_may_change_what_does_not_steer_the_run(tmp_path, tokenizer, checkpoint):
    """Output folder, logging, saving, evaluation, optim (es_optimizer="es" never steps it: the checkpoint's SGD state
    is not loaded into this run's AdamW, the KeyError 'betas' of before) may change: the run ends bitwise as the
    uninterrupted one, and its seed log holds steps 1-4 with the checkpoint's header."""
    folder, final = checkpoint
    args = es_args(tmp_path, max_steps=4, awd_lambda=1.0, awd_penalty="l2", optim="adamw_torch", logging_steps=3,
                   save_strategy="steps", save_steps=3, success_threshold=0.5, anchor_storage="memory")
    trainer = ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=prompts(),
                        processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=folder)
    assert_bitwise(snapshot(trainer.model), final)
    assert steps(args.output_dir) == [1, 2, 3, 4]
    assert_bitwise(snapshot(replay(build_llama(tokenizer), args.output_dir)), final)


def test_sgd_checkpoint_resumed_with_the_es_optimizer_is_refused(tmp_path, tokenizer):
    """The issue's second input: optim="sgd" with es_optimizer="torch", resumed with es_optimizer="es"."""
    first = es_args(tmp_path / "sgd", max_steps=2, save_strategy="steps", save_steps=2, es_optimizer="torch",
                    optim="sgd")
    ESTrainer(build_llama(tokenizer), mean_code, args=first, train_dataset=prompts(),
              processing_class=tokenizer).train()
    trainer = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path / "es", max_steps=4),
                        train_dataset=prompts(), processing_class=tokenizer)
    with pytest.raises(ValueError, match=r"es_optimizer \(checkpoint: 'torch', this run: 'es'\)"):
        trainer.train(resume_from_checkpoint=os.path.join(first.output_dir, "checkpoint-2"))


# ---------------------------------------------------------------------------------------------- class 4: files
def copy_with_patterns(src, dst, suffixes=(".json", ".safetensors")):
    """A checkpoint copied as `cp checkpoint-2/*.json checkpoint-2/*.safetensors dst/` would copy it."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if name.endswith(suffixes):
            shutil.copy(os.path.join(src, name), dst)
    return str(dst)


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory, tokenizer):
    """Two 4-step runs that saved checkpoint-2: one plain (fp32), one with the torch optimizer and a bf16 model."""
    tmp_path = tmp_path_factory.mktemp("files")
    out = {}
    for name, kwargs, dtype in (("plain", {}, torch.float32),
                                ("torch_bf16", {"es_optimizer": "torch", "learning_rate": 1e-3}, torch.bfloat16)):
        args = es_args(tmp_path / name, max_steps=4, save_strategy="steps", save_steps=2, **kwargs)
        ESTrainer(build_llama(tokenizer, dtype=dtype), mean_code, args=args, train_dataset=prompts(),
                  processing_class=tokenizer).train()
        out[name] = (args, dtype, kwargs)
    return out


def resume_error(tmp_path, tokenizer, run, folder, **extra):
    args, dtype, kwargs = run
    trainer = ESTrainer(build_llama(tokenizer, dtype=dtype), mean_code, train_dataset=prompts(),
                        args=es_args(tmp_path / "resumed", max_steps=4, **kwargs, **extra), processing_class=tokenizer)
    with pytest.raises(ValueError) as error:
        trainer.train(resume_from_checkpoint=folder)
    assert trainer.state.global_step == 0 and trainer.seed_log.records == []
    return str(error.value)


def copy_checkpoint(run, tmp_path) -> str:
    """A whole copy of the run's checkpoint-2 in ``tmp_path/copied``, to take files from."""
    folder = str(tmp_path / "copied")
    shutil.copytree(os.path.join(run[0].output_dir, "checkpoint-2"), folder)
    return folder


def test_checkpoint_copied_by_file_patterns_is_refused_naming_its_missing_files(tmp_path, tokenizer, run_dirs):
    run = run_dirs["plain"]
    folder = copy_with_patterns(os.path.join(run[0].output_dir, "checkpoint-2"), tmp_path / "copied")
    message = resume_error(tmp_path, tokenizer, run, folder)
    assert "it holds no es_seed_log.jsonl and no scheduler.pt and no rng_state.pth (" in message, message


def test_torch_optimizer_checkpoint_without_its_state_is_refused(tmp_path, tokenizer, run_dirs):
    """bf16 model, es_optimizer="torch": the fp32 master and optimizer.pt are needed (not the anchor: it is off)."""
    run = run_dirs["torch_bf16"]
    folder = copy_checkpoint(run, tmp_path)
    for name in ("optimizer.pt", MASTER_WEIGHTS_NAME, "trainer_state.json"):
        os.remove(os.path.join(folder, name))
    message = resume_error(tmp_path, tokenizer, run, folder, log_parameter_drift=False)
    assert f"it holds no {MASTER_WEIGHTS_NAME} and no trainer_state.json and no optimizer.pt (" in message, message


def test_checkpoint_without_its_anchor_is_refused_when_the_run_holds_theta_0(tmp_path, tokenizer, run_dirs):
    run = run_dirs["plain"]
    folder = copy_checkpoint(run, tmp_path)
    os.remove(os.path.join(folder, ANCHOR_WEIGHTS_NAME))
    message = resume_error(tmp_path, tokenizer, run, folder)
    assert f"it holds no {ANCHOR_WEIGHTS_NAME} (" in message, message


def drop_steps(path, dropped):
    with open(path) as f:
        lines = f.readlines()
    with open(path, "w") as f:
        f.writelines(line for i, line in enumerate(lines) if i not in dropped)


def test_checkpoint_whose_seed_log_lacks_a_step_is_refused(tmp_path, tokenizer, run_dirs):
    run = run_dirs["plain"]
    folder = copy_checkpoint(run, tmp_path)
    drop_steps(os.path.join(folder, SEED_LOG_NAME), {1})  # the line of step 1
    message = resume_error(tmp_path, tokenizer, run, folder)
    assert "this one has missing steps [1] (the log does not start at step 1, the base model)" in message, message


def test_checkpoint_holding_the_seed_log_of_another_step_is_refused(tmp_path, tokenizer, run_dirs):
    """The final log (steps 1-4) copied into checkpoint-2: its trainer_state.json is at step 2."""
    run = run_dirs["plain"]
    folder = copy_checkpoint(run, tmp_path)
    shutil.copy(os.path.join(run[0].output_dir, SEED_LOG_NAME), folder)
    message = resume_error(tmp_path, tokenizer, run, folder)
    assert "its trainer_state.json is at step 2 but its es_seed_log.jsonl ends at step 4" in message, message


@pytest.mark.parametrize(
    "dropped, message",
    [
        ({1, 2}, r"missing steps \[1, 2\] \(the log does not start at step 1"),  # the log of steps 3-4
        ({3}, r"missing steps \[3\]"),
    ],
    ids=["starts_at_3", "lacks_3"],
)
def test_replay_and_load_refuse_a_log_with_missing_steps(tmp_path, tokenizer, run_dirs, dropped, message):
    path = str(tmp_path / SEED_LOG_NAME)
    shutil.copy(os.path.join(run_dirs["plain"][0].output_dir, SEED_LOG_NAME), path)
    drop_steps(path, dropped)
    with pytest.raises(ValueError, match=message):
        SeedLog.load(path)
    with pytest.raises(ValueError, match=message):
        replay(build_llama(tokenizer), path)


def test_replay_refuses_repeated_steps_and_a_max_step_beyond_the_log(tmp_path, tokenizer, run_dirs):
    path = str(tmp_path / SEED_LOG_NAME)
    with open(os.path.join(run_dirs["plain"][0].output_dir, SEED_LOG_NAME)) as f:
        lines = f.readlines()
    with open(path, "w") as f:
        f.writelines(lines[:3] + lines[1:])  # steps 1, 2, 1, 2, 3, 4: two runs' logs joined
    with pytest.raises(ValueError, match=r"repeated steps \[1, 2\]"):
        replay(build_llama(tokenizer), path)
    with pytest.raises(ValueError, match=r"max_step=6 is beyond .* ends at step 4: steps \[5, 6\] are missing"):
        replay(build_llama(tokenizer), run_dirs["plain"][0].output_dir, max_step=6)


# ---------------------------------------------------------------------------------------------- class 2: weights
class ScriptedEval:
    """mean_code on training prompts; on the eval prompts ("Eval: i") a reward set by the step (``by_step``)."""

    __name__ = "scripted"

    def __init__(self, by_step):
        self.by_step = by_step

    def __call__(self, prompts, completions, trainer_state, **kwargs):
        if str(prompts[0]).startswith("Eval"):
            return [self.by_step[trainer_state.global_step]] * len(completions)
        return mean_code(completions)


@pytest.mark.parametrize(
    "dtype, kwargs",
    [(torch.float32, {}), (torch.bfloat16, {"awd_lambda": 1.0})],
    ids=["fp32", "bf16_awd"],
)
def test_load_best_model_at_end_loads_the_best_steps_es_state(tmp_path, tokenizer, dtype, kwargs):
    """Eval every step, best at step 2 of 4: the model, master and seed log are those of checkpoint-2; the saved model
    replays bitwise from its saved seed log (with AWD, also theta_0 is the run's)."""
    args = es_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
                   load_best_model_at_end=True, metric_for_best_model="eval_reward", greater_is_better=True, **kwargs)
    trainer = ESTrainer(build_llama(tokenizer, dtype=dtype), ScriptedEval({1: 0.1, 2: 0.9, 3: 0.3, 4: 0.2}), args=args,
                        train_dataset=prompts(), eval_dataset=Dataset.from_dict({"prompt": ["Eval: 0", "Eval: 1"]}),
                        processing_class=tokenizer)
    anchor = {n: t.clone() for n, t in trainer.anchor.items()} if kwargs else None
    trainer.train()
    best = os.path.join(args.output_dir, "checkpoint-2")
    assert trainer.state.best_model_checkpoint == best
    assert [r["step"] for r in trainer.seed_log.records] == [1, 2]
    assert steps(args.output_dir) == [1, 2]  # the seed log train() writes beside the output
    assert_bitwise(snapshot(trainer.model), model_file(best))
    if dtype == torch.bfloat16:
        masters = load_file(os.path.join(best, MASTER_WEIGHTS_NAME))
        assert_bitwise({n: t.clone() for n, t in trainer.es_params.master_state_dict().items()}, masters)
        assert all(torch.equal(trainer.anchor[n], anchor[n]) for n in anchor)
    final = str(tmp_path / "final")
    trainer.save_model(final)
    assert steps(final) == [1, 2]
    assert_bitwise(snapshot(replay(build_llama(tokenizer, dtype=dtype), final)), model_file(final))
    assert_bitwise(model_file(final), model_file(best))


def test_training_on_after_load_best_continues_from_the_best_weights(tmp_path, tokenizer):
    """A second train() after load-best: steps 3-4 of the seed log continue from the best weights, and equal a new
    trainer started from the best checkpoint's model; the saved model replays from the base bitwise."""
    args = es_args(tmp_path, max_steps=3, save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
                   load_best_model_at_end=True, metric_for_best_model="eval_reward")
    eval_data = Dataset.from_dict({"prompt": ["Eval: 0"]})
    trainer = ESTrainer(build_llama(tokenizer), ScriptedEval({1: 0.5, 2: 0.1, 3: 0.2}), args=args,
                        train_dataset=prompts(), eval_dataset=eval_data, processing_class=tokenizer)
    trainer.train()
    best = os.path.join(args.output_dir, "checkpoint-1")
    assert trainer.state.best_model_checkpoint == best
    for name, value in (("load_best_model_at_end", False), ("save_strategy", "no"), ("eval_strategy", "no"),
                        ("max_steps", 2), ("output_dir", str(tmp_path / "more"))):
        setattr(trainer.args, name, value)
    trainer.train()
    assert [(r["step"], r.get("global_step")) for r in trainer.seed_log.records] == [(1, None), (2, 1), (3, 2)]
    assert_bitwise(snapshot(replay(build_llama(tokenizer), str(tmp_path / "more"))), snapshot(trainer.model))
    reference = ESTrainer(AutoModelForCausalLM.from_pretrained(best), ScriptedEval({}), train_dataset=prompts(),
                          args=es_args(tmp_path / "reference", max_steps=2), processing_class=tokenizer)
    reference.train()
    assert_bitwise(snapshot(trainer.model), snapshot(reference.model))


def test_model_init_rebuilds_the_es_state_for_each_new_model(tmp_path, tokenizer, monkeypatch):
    """With model_init (hyperparameter_search), every train() starts from a new model: ES trains that model (not the
    first one), with a fresh seed log, as a new trainer on it would; a trial's settings (here population_size,
    learning_rate, as hyperparameter_search sets them) are in the rebuilt state and its seed log."""
    from transformers.trainer_utils import HPSearchBackend

    trainer = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path / "init", max_steps=2),
                        train_dataset=prompts(), processing_class=tokenizer)
    other = build_llama(tokenizer, seed=1)
    trainer.model_init = lambda: copy.deepcopy(other)  # (a model_init that seeds torch would change the data order)
    trainer.train()
    reference = ESTrainer(build_llama(tokenizer, seed=1), mean_code, args=es_args(tmp_path / "ref", max_steps=2),
                          train_dataset=prompts(), processing_class=tokenizer)
    reference.train()
    assert_bitwise(snapshot(trainer.model), snapshot(reference.model))
    assert [r["step"] for r in trainer.seed_log.records] == [1, 2]

    # A trial as hyperparameter_search(backend="optuna") gives one to train() (optuna is not installed here).
    monkeypatch.setattr("transformers.integrations.hp_params", lambda trial: trial.params)
    trainer.hp_search_backend, trainer.hp_space = HPSearchBackend.OPTUNA, lambda trial: trial.params
    trainer.train(trial=SimpleNamespace(number=0, params={"population_size": 6, "learning_rate": 0.05}))
    trial = ESTrainer(build_llama(tokenizer, seed=1), mean_code, train_dataset=prompts(), processing_class=tokenizer,
                      args=es_args(tmp_path / "trial", max_steps=2, population_size=6, learning_rate=0.05))
    trial.train()
    assert_bitwise(snapshot(trainer.model), snapshot(trial.model))
    assert trainer.seed_log.header["population_size"] == 6 and len(trainer.seed_log.records[0]["members"]) == 6
    assert_bitwise(snapshot(replay(build_llama(tokenizer, seed=1), str(tmp_path / "init" / "out"))),
                   snapshot(trainer.model))
