"""Parallel averaging of RL (GRPO) or ES updates with SFT updates (arXiv 2606.04272), on a tiny model.

The averaged step is checked bitwise against the same updates taken by hand, each from the same snapshot with a
fresh optimizer: GRPO alone (TRL's GRPOTrainer), SFT alone (the SFT side on its own), ES alone (``es_update_``).
"""

import copy

import pytest
import torch
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from trl_es import (
    ESParallelAveragingConfig,
    ESParallelAveragingTrainer,
    ParallelAveragingConfig,
    ParallelAveragingTrainer,
    replay,
)
from trl_es.es.perturbation import GaussianPerturbation, LowRankPerturbation, Member, TrainedParameters, es_update_
from trl_es.tasks.arithmetic import make_arithmetic_dataset_dict, make_arithmetic_sft_dataset, worked_answer
from trl_es.trainer.averaging.parallel_averaging_trainer import average_updates_
from trl_es.trainer.averaging.sft_step import SFTStep, sft_config_from
from tiny import content_reward

pytestmark = pytest.mark.usefixtures("one_thread")


class Reseed(TrainerCallback):
    """The same sampling stream in every trainer of a test, whatever their construction consumed."""

    def on_train_begin(self, args, state, control, **kwargs):
        torch.manual_seed(123)


@pytest.fixture(scope="module")
def data():
    splits = make_arithmetic_dataset_dict(16, 0, 0, seed=3, high=9)
    return splits["train"], make_arithmetic_sft_dataset(splits["train"])


def grpo_kwargs(tmp_path, max_steps=1):
    return dict(output_dir=str(tmp_path), learning_rate=1e-2, num_generations=4, per_device_train_batch_size=4,
                max_completion_length=6, temperature=1.0, beta=0.0, max_steps=max_steps, logging_steps=1,
                lr_scheduler_type="constant", report_to="none", save_strategy="no", bf16=False,
                activation_checkpointing=False, use_cpu=True, seed=0, disable_tqdm=True)


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_sft_dataset_is_prompt_completion_with_the_worked_answer(data):
    rl, sft = data
    assert sft.column_names == rl.column_names + ["completion"]
    row = sft[0]
    answer = f"{row['a']} {row['op']} {row['b']} = {row['answer']}"
    assert row["completion"] == [{"role": "assistant", "content": answer}]
    assert worked_answer(47, "+", 35) == "47 + 35 = 82" and worked_answer(6, "*", 7) == "6 * 7 = 42"
    plain = make_arithmetic_sft_dataset(make_arithmetic_dataset_dict(2, 0, 0, conversational=False)["train"])
    # a plain prompt and its completion are joined as they are: the space before the answer is the completion's
    assert plain[0]["completion"] == " " + worked_answer(plain[0]["a"], plain[0]["op"], plain[0]["b"])
    with pytest.raises(ValueError, match="completion"):
        make_arithmetic_sft_dataset(sft)


def test_average_updates_formula():
    bar, a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 2.0]), torch.tensor([1.0, -2.0])
    p = b.clone()
    average_updates_([p], [bar], [a], 0.5, 0.5)
    assert p.tolist() == [2.0, 0.0]  # 1 + (2 + 0)/2 ; 2 + (0 - 4)/2
    p = b.clone()
    average_updates_([p], [bar], [a], 1.0, 0.0)
    assert torch.equal(p, a)


def test_grpo_sft_step_is_the_average_of_both_updates_from_theta_bar(tokenizer, data, tmp_path):
    from tiny import build_llama

    rl, sft = data
    base = build_llama(tokenizer)
    theta_bar = params_of(base)

    # RL + SFT, averaged
    averaged = copy.deepcopy(base)
    config = ParallelAveragingConfig(**grpo_kwargs(tmp_path / "pa"), sft_per_device_train_batch_size=4)
    trainer = ParallelAveragingTrainer(averaged, content_reward, args=config, train_dataset=rl, sft_dataset=sft,
                                       processing_class=tokenizer, callbacks=[Reseed()])
    trainer.train()

    # RL alone: TRL's GRPOTrainer, same config, same sampling stream, fresh optimizer
    rl_only = copy.deepcopy(base)
    GRPOTrainer(rl_only, content_reward, args=GRPOConfig(**grpo_kwargs(tmp_path / "rl")), train_dataset=rl,
                processing_class=tokenizer, callbacks=[Reseed()]).train()
    theta_rl = params_of(rl_only)

    # SFT alone, from the same snapshot, fresh optimizer
    sft_only = copy.deepcopy(base)
    sft_args = sft_config_from(GRPOConfig(**grpo_kwargs(tmp_path / "sft")), learning_rate=1e-2,
                               per_device_train_batch_size=4, max_length=1024, completion_only_loss=None,
                               max_grad_norm=1.0)
    SFTStep(sft_only, tokenizer, sft, sft_args, num_training_steps=1).step(0)
    theta_sft = params_of(sft_only)

    changed_rl = changed_sft = 0
    for name, p in averaged.named_parameters():
        bar, r, s = theta_bar[name], theta_rl[name], theta_sft[name]
        expected = bar + 0.5 * (r - bar) + 0.5 * (s - bar)
        assert torch.equal(p.detach(), expected), name
        changed_rl += int(not torch.equal(r, bar))
        changed_sft += int(not torch.equal(s, bar))
    n = len(theta_bar)
    assert changed_rl == n and changed_sft >= n - 1  # both updates moved (nearly) every tensor: a real average
    logged = [h for h in trainer.state.log_history if "sft/loss" in h][0]
    assert logged["sft/loss"] > 0 and logged["update_norm/rl"] > 0 and logged["update_norm/sft"] > 0
    # the host's forward was left as GRPO installed it (the SFT patch is only swapped in for the SFT step)
    assert averaged.forward.__func__ is not trainer.sft_step._sft_forward.__func__


def test_grpo_and_sft_optimizers_keep_separate_states(tokenizer, data, tmp_path):
    from tiny import build_llama

    rl, sft = data
    config = ParallelAveragingConfig(**grpo_kwargs(tmp_path, max_steps=2), sft_per_device_train_batch_size=4,
                                     sft_learning_rate=3e-3)
    trainer = ParallelAveragingTrainer(build_llama(tokenizer), content_reward, args=config, train_dataset=rl,
                                       sft_dataset=sft, processing_class=tokenizer)
    trainer.train()
    rl_optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    sft_optimizer = trainer.sft_step.optimizer
    assert rl_optimizer is not sft_optimizer
    assert type(rl_optimizer) is type(sft_optimizer)  # same class (AdamW) ...
    assert rl_optimizer.param_groups[0]["lr"] == 1e-2 and sft_optimizer.param_groups[0]["lr"] == 3e-3  # own lr
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    for p in params:
        rl_state, sft_state = rl_optimizer.state[p], sft_optimizer.state[p]
        assert rl_state is not sft_state
        assert float(rl_state["step"]) == 2.0 and float(sft_state["step"]) == 2.0  # one step each per training step
        for key in ("exp_avg", "exp_avg_sq"):
            assert rl_state[key].data_ptr() != sft_state[key].data_ptr()
            assert not torch.equal(rl_state[key], sft_state[key])  # moments of different gradients


def es_kwargs(tmp_path, **overrides):
    kwargs = dict(output_dir=str(tmp_path), population_size=4, antithetic=True, sigma=0.1, learning_rate=0.05,
                  prompt_batch_size=2, max_completion_length=6, max_steps=1, noise_table_size=2**20,
                  report_to="none", save_strategy="no", logging_steps=1, seed=0, sft_learning_rate=1e-2,
                  sft_per_device_train_batch_size=4, disable_tqdm=True)
    kwargs.update(overrides)
    return kwargs


@pytest.mark.parametrize("backend", ["sequential", "batched_lowrank"])
def test_es_sft_step_is_the_es_share_plus_the_weighted_sft_update(tokenizer, data, tmp_path, backend):
    """Also with the main job's batched low-rank backend (fp32: the masters are the model's own weights)."""
    from tiny import build_llama

    rl, sft = data
    base = build_llama(tokenizer)
    theta_bar = params_of(base)
    averaged = copy.deepcopy(base)
    config = ESParallelAveragingConfig(**es_kwargs(tmp_path / "es_sft", population_backend=backend))
    perturbation = GaussianPerturbation() if backend == "sequential" else LowRankPerturbation(config.noise_rank)
    trainer = ESParallelAveragingTrainer(averaged, content_reward, args=config, train_dataset=rl, sft_dataset=sft,
                                         processing_class=tokenizer)
    trainer.train()
    record = trainer.seed_log.records[0]
    assert record["learning_rate"] == 0.5 * 0.05  # the ES share: w_ES * alpha
    assert any(c != 0 for c in record["coefficients"])
    names = [name for name, _ in trainer.seed_log.header["parameters"]]

    # ES alone from the same snapshot: es_update_ with the logged members and coefficients at w_ES * alpha
    es_only = copy.deepcopy(base)
    named = dict(es_only.named_parameters())
    es_params = TrainedParameters([(n, named[n]) for n in names])
    members = [Member(seed, sign) for seed, sign in record["members"]]
    es_update_(es_params, perturbation, trainer.noise, members, record["coefficients"], record["learning_rate"])
    theta_es = {n: m.clone() for n, m in es_params.master_state_dict().items()}

    # SFT alone from the same snapshot, with a fresh optimizer over fresh fp32 masters
    sft_only = copy.deepcopy(base)
    named = dict(sft_only.named_parameters())
    sft_params = TrainedParameters([(n, named[n]) for n in names])
    sft_args = sft_config_from(config, learning_rate=1e-2, per_device_train_batch_size=4, max_length=1024,
                               completion_only_loss=None, max_grad_norm=1.0)
    SFTStep(sft_only, tokenizer, sft, sft_args, num_training_steps=1,
            targets=[(named[n], m) for n, m in zip(names, sft_params.master_parameters())]).step(0)
    theta_sft = sft_params.master_state_dict()

    masters = trainer.es_params.master_state_dict()
    model_params = dict(averaged.named_parameters())
    for n in names:
        bar = theta_bar[n]
        expected = theta_es[n] + 0.5 * (theta_sft[n] - bar)
        assert torch.equal(masters[n], expected), n
        assert torch.equal(model_params[n].detach(), expected), n  # rendered into the model
        assert not torch.equal(theta_es[n], bar) and not torch.equal(theta_sft[n], bar)
    logged = [h for h in trainer.state.log_history if "sft/loss" in h][0]
    assert logged["update_norm/es"] > 0 and logged["update_norm/sft"] > 0


def test_es_share_alone_replays_bitwise(tokenizer, data, tmp_path):
    """With sft_weight = 0 the run is plain ES at alpha * w_ES: the seed log replays it bitwise."""
    from tiny import build_llama

    rl, sft = data
    base = build_llama(tokenizer)
    trained = copy.deepcopy(base)
    config = ESParallelAveragingConfig(**es_kwargs(tmp_path, max_steps=2, sft_weight=0.0))
    ESParallelAveragingTrainer(trained, content_reward, args=config, train_dataset=rl, sft_dataset=sft,
                               processing_class=tokenizer).train()
    rebuilt = replay(copy.deepcopy(base), str(tmp_path))
    for (name, p), q in zip(trained.named_parameters(), rebuilt.parameters()):
        assert torch.equal(p, q), name
    # with an SFT share the log holds the ES part only: replay refuses it instead of rebuilding other weights
    averaged = tmp_path / "averaged"
    config = ESParallelAveragingConfig(**es_kwargs(averaged, max_steps=1, sft_weight=0.5))
    ESParallelAveragingTrainer(copy.deepcopy(base), content_reward, args=config, train_dataset=rl, sft_dataset=sft,
                               processing_class=tokenizer).train()
    with pytest.raises(ValueError, match="cannot be replayed: ES \\+ SFT parallel averaging with sft_weight=0.5"):
        replay(copy.deepcopy(base), str(averaged))


def test_config_validation_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="rl_weight"):
        ParallelAveragingConfig(**grpo_kwargs(tmp_path), rl_weight=-0.5)
    with pytest.raises(ValueError, match="both 0"):
        ParallelAveragingConfig(**grpo_kwargs(tmp_path), rl_weight=0.0, sft_weight=0.0)
    with pytest.raises(ValueError, match="sft_per_device_train_batch_size"):
        ParallelAveragingConfig(**grpo_kwargs(tmp_path), sft_per_device_train_batch_size=0)
    with pytest.raises(ValueError, match="es_optimizer"):
        ESParallelAveragingConfig(**es_kwargs(tmp_path), es_optimizer="torch")
    with pytest.raises(ValueError, match="sft_learning_rate"):
        ESParallelAveragingConfig(**es_kwargs(tmp_path, sft_learning_rate=0.0))


def test_checkpoint_holds_the_sft_optimizer_and_resume_restores_it(tokenizer, data, tmp_path):
    from tiny import build_llama

    rl, sft = data
    kwargs = dict(grpo_kwargs(tmp_path, max_steps=2), save_strategy="steps", save_steps=1)
    config = ParallelAveragingConfig(**kwargs, sft_per_device_train_batch_size=4)
    ParallelAveragingTrainer(build_llama(tokenizer), content_reward, args=config, train_dataset=rl, sft_dataset=sft,
                             processing_class=tokenizer).train()
    checkpoint = tmp_path / "checkpoint-1"
    saved = torch.load(checkpoint / "sft_optimizer.pt", weights_only=True)
    assert [float(s["step"]) for s in saved["optimizer"]["state"].values()][:1] == [1.0]
    resumed = ParallelAveragingTrainer(build_llama(tokenizer), content_reward, args=config, train_dataset=rl,
                                       sft_dataset=sft, processing_class=tokenizer)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    states = resumed.sft_step.optimizer.state.values()
    assert states and all(float(s["step"]) == 2.0 for s in states)  # 1 step from the checkpoint + 1 after resuming


def test_shared_sft_fields_keep_each_configs_order_defaults_and_fallbacks(tmp_path):
    """The sft_* fields are declared once (SFTAveragingFields); each config keeps its weight first, its defaults, and
    its rule for None (GRPO: the host's learning_rate / max_grad_norm; ES: passed on as it is)."""
    import dataclasses

    from trl import TrlParser

    sft_names = ["sft_weight", "sft_learning_rate", "sft_per_device_train_batch_size", "sft_max_length",
                 "sft_completion_only_loss", "sft_max_grad_norm"]
    for cls, weight in ((ParallelAveragingConfig, "rl_weight"), (ESParallelAveragingConfig, "es_weight")):
        fields = dataclasses.fields(cls)
        assert [f.name for f in fields][-7:] == [weight, *sft_names], cls.__name__
        assert all(f.metadata.get("help") for f in fields[-7:]), cls.__name__  # TrlParser's --help for each
    grpo = ParallelAveragingConfig(**grpo_kwargs(tmp_path), max_grad_norm=0.25)
    assert (grpo.rl_weight, grpo.sft_weight, grpo.sft_learning_rate, grpo.sft_max_grad_norm) == (0.5, 0.5, None, None)
    sft = grpo.sft_config()
    assert (sft.learning_rate, sft.max_grad_norm, sft.per_device_train_batch_size, sft.max_length) == (
        1e-2, 0.25, 8, 1024)
    sft = ParallelAveragingConfig(**grpo_kwargs(tmp_path), sft_learning_rate=3e-3, sft_max_grad_norm=0.0).sft_config()
    assert (sft.learning_rate, sft.max_grad_norm) == (3e-3, 0.0)
    es = ESParallelAveragingConfig(output_dir=str(tmp_path))
    assert (es.es_weight, es.sft_weight, es.sft_learning_rate, es.sft_max_grad_norm) == (0.5, 0.5, 1e-5, 1.0)
    sft = es.sft_config()
    assert (sft.learning_rate, sft.max_grad_norm, sft.completion_only_loss) == (1e-5, 1.0, None)
    sft = ESParallelAveragingConfig(output_dir=str(tmp_path), sft_max_grad_norm=None, max_grad_norm=0.5).sft_config()
    assert sft.max_grad_norm is None  # not ES's max_grad_norm
    (parsed,) = TrlParser((ESParallelAveragingConfig,)).parse_args_and_config(
        ["--output_dir", str(tmp_path), "--es_weight", "0.3", "--sft_weight", "0.7", "--sft_max_length", "64"])
    assert (parsed.es_weight, parsed.sft_weight, parsed.sft_max_length) == (0.3, 0.7, 64)
    (parsed,) = TrlParser((ParallelAveragingConfig,)).parse_args_and_config(
        ["--output_dir", str(tmp_path), "--bf16", "false", "--use_cpu", "true", "--rl_weight", "0.3",
         "--sft_learning_rate", "1e-4"])
    assert (parsed.rl_weight, parsed.sft_weight, parsed.sft_learning_rate) == (0.3, 0.5, 1e-4)


def test_constructor_checks_name_each_trainer(tokenizer, data, tmp_path):
    rl, sft = data
    with pytest.raises(TypeError, match="^args must be a ParallelAveragingConfig, got GRPOConfig"):
        ParallelAveragingTrainer("x", content_reward, args=GRPOConfig(**grpo_kwargs(tmp_path)), sft_dataset=sft)
    with pytest.raises(TypeError, match="^args must be an ESParallelAveragingConfig, got ParallelAveragingConfig"):
        ESParallelAveragingTrainer("x", content_reward, args=ParallelAveragingConfig(**grpo_kwargs(tmp_path)),
                                   sft_dataset=sft)
    with pytest.raises(ValueError, match="^ParallelAveragingTrainer needs an sft_dataset"):
        ParallelAveragingTrainer("x", content_reward, args=ParallelAveragingConfig(**grpo_kwargs(tmp_path)),
                                 train_dataset=rl)
    with pytest.raises(ValueError, match="^ESParallelAveragingTrainer needs an sft_dataset"):
        ESParallelAveragingTrainer("x", content_reward, args=ESParallelAveragingConfig(**es_kwargs(tmp_path)),
                                   train_dataset=rl)


def test_es_checkpoint_holds_the_sft_optimizer_and_resume_restores_it(tokenizer, data, tmp_path):
    import shutil

    from tiny import build_llama

    rl, sft = data
    config = ESParallelAveragingConfig(**es_kwargs(tmp_path, max_steps=2, save_strategy="steps", save_steps=1))
    ESParallelAveragingTrainer(build_llama(tokenizer), content_reward, args=config, train_dataset=rl,
                               sft_dataset=sft, processing_class=tokenizer).train()
    checkpoint = tmp_path / "checkpoint-1"
    saved = torch.load(checkpoint / "sft_optimizer.pt", weights_only=True)
    assert saved["optimizer"]["state"] and all(float(s["step"]) == 1.0 for s in saved["optimizer"]["state"].values())
    assert saved["lr_scheduler"]["last_epoch"] == 1
    resumed = ESParallelAveragingTrainer(build_llama(tokenizer), content_reward, args=config, train_dataset=rl,
                                         sft_dataset=sft, processing_class=tokenizer)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    states = resumed.sft_step.optimizer.state.values()
    assert states and all(float(s["step"]) == 2.0 for s in states)  # 1 step from the checkpoint + 1 after resuming
    incomplete = tmp_path / "incomplete"
    shutil.copytree(checkpoint, incomplete)
    (incomplete / "sft_optimizer.pt").unlink()
    again = ESParallelAveragingTrainer(build_llama(tokenizer), content_reward, args=config, train_dataset=rl,
                                       sft_dataset=sft, processing_class=tokenizer)
    with pytest.raises(ValueError, match="^Cannot resume ESParallelAveragingTrainer from .*: no sft_optimizer.pt"):
        again.train(resume_from_checkpoint=str(incomplete))
