"""Two fault classes of issue 32, each with several inputs.

Precision: with mixed precision (``bf16=True`` on the CPU) every forward pass of a trainer runs the same computation:
``evaluate()`` before ``train()``, the members' rollouts (both population backends, also outside ``train()``),
``evaluate()`` after it, the SFT step of ES + SFT averaging, and Hyper-ES's fitness and ``evaluate``. ``fp16=True``,
which accelerate does not apply on the CPU, is refused instead of running fp32 silently.

Derived fields: GRPO's batch fields (``per_device_train_batch_size``, ``gradient_accumulation_steps``) keep GRPO's
meaning and are mapped onto ``prompt_batch_size`` (issue 63; tests/trainer/test_grpo_recipes.py); set together with a
``prompt_batch_size`` they disagree with, both are named in the error.
"""

import copy
import warnings

import pytest
import torch
from datasets import Dataset
from tiny import build_llama

from trl_es import ESConfig, ESParallelAveragingConfig, ESParallelAveragingTrainer, ESTrainer
from trl_es.trainer.hyper_es.hyper_es_config import HyperESConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def prompts(n=4):
    return Dataset.from_dict({"prompt": [f"Write: {i}" for i in range(n)]})


def es_config(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path / "out"), max_steps=1, population_size=4, antithetic=True,
                    prompt_batch_size=4, max_completion_length=4, sigma=0.02, learning_rate=0.02, report_to=[],
                    save_strategy="no", noise_table_size=1 << 20, disable_tqdm=True, seed=0, bf16=True,
                    use_cpu=True)
    defaults.update(kwargs)
    return ESConfig(**defaults)


def code_reward(completions, **kwargs):
    """A reward that differs between almost any two completions (text or conversational)."""
    from trl_es.rewards import completion_text

    return [float(sum(map(ord, completion_text(c)))) for c in completions]


class Recorder:
    """Forward hooks that record, per phase, the autocast state and output dtype of the LM head and of the model's
    logits, and the LM head's outputs themselves in the phases named in ``keep``."""

    def __init__(self, model, keep=()):
        self.phase, self.keep = None, set(keep)
        self.states, self.outputs = {}, {}
        model.lm_head.register_forward_hook(self._head)
        model.register_forward_hook(self._model)

    def _head(self, module, args, out):
        self.states.setdefault(self.phase, set()).add(("lm_head", torch.is_autocast_enabled("cpu"), out.dtype))
        if self.phase in self.keep:
            self.outputs.setdefault(self.phase, []).append(out.detach().clone())

    def _model(self, module, args, out):
        self.states.setdefault(self.phase, set()).add(("logits", out.logits.dtype))


# ---------------------------------------------------------------------------------------------- precision
@pytest.mark.parametrize("backend", ["sequential", "batched_lowrank"])
def test_evaluate_before_and_after_train_runs_the_members_computation(tmp_path, tokenizer, backend):
    """bf16 on the CPU: evaluate() before train(), the members' rollouts and evaluate() after it run under one
    autocast state; with the weights unchanged by training (equal fitness: zero update), the two evaluations give
    bitwise the same LM-head outputs and rewards."""
    model = build_llama(tokenizer)
    recorder = Recorder(model, keep=("before", "after"))
    rewards = {}

    def reward(completions, **kwargs):
        if recorder.phase == "train":
            return [1.0] * len(completions)  # equal fitness: the ES update is zero, the weights stay as they are
        values = code_reward(completions)
        rewards.setdefault(recorder.phase, []).extend(values)
        return values

    trainer = ESTrainer(model, reward, args=es_config(tmp_path, population_backend=backend), train_dataset=prompts(),
                        eval_dataset=prompts(), processing_class=tokenizer)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    recorder.phase = "before"
    before = trainer.evaluate()
    recorder.phase = "train"
    trainer.train()
    recorder.phase = "after"
    after = trainer.evaluate()

    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    expected = {("lm_head", True, torch.bfloat16), ("logits", torch.float32)}  # accelerate's autocast, fp32 outputs
    assert recorder.states == {"before": expected, "train": expected, "after": expected}
    assert rewards["before"] == rewards["after"] and before["eval_reward"] == after["eval_reward"]
    assert len(recorder.outputs["before"]) == len(recorder.outputs["after"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(recorder.outputs["before"], recorder.outputs["after"], strict=True))


def test_members_scored_before_any_evaluate_or_train_use_the_same_precision(tmp_path, tokenizer):
    """The member loop called on its own (as benchmarks and tests do, outside train()) runs under the same autocast
    as evaluate()."""
    model = build_llama(tokenizer)
    recorder = Recorder(model)
    trainer = ESTrainer(model, code_reward, args=es_config(tmp_path), train_dataset=prompts(),
                        eval_dataset=prompts(), processing_class=tokenizer)
    recorder.phase = "members"
    members = trainer.population.ask(0, 0, 4, True)
    trainer._score_members(members, list(prompts()), step=0)
    recorder.phase = "evaluate"
    trainer.evaluate()
    assert recorder.states["members"] == recorder.states["evaluate"] == {
        ("lm_head", True, torch.bfloat16), ("logits", torch.float32)}


def test_without_mixed_precision_evaluate_leaves_the_model_unprepared(tmp_path, tokenizer):
    """fp32 runs are untouched: evaluate() neither prepares the model nor wraps its forward."""
    model = build_llama(tokenizer)
    trainer = ESTrainer(model, code_reward, args=es_config(tmp_path, bf16=False), train_dataset=prompts(),
                        eval_dataset=prompts(), processing_class=tokenizer)
    trainer.evaluate()
    assert "forward" not in model.__dict__ and not getattr(model, "_is_accelerate_prepared", False)


def test_es_sft_step_runs_under_the_members_precision(tmp_path, tokenizer):
    """ES + SFT averaging with bf16: the SFT step's forward (TRL's fused LM head, installed for the step only) runs
    under the same autocast as the members' rollouts; before, it ran in fp32."""
    from trl_es.tasks.arithmetic import make_arithmetic_dataset_dict, make_arithmetic_sft_dataset

    rl = make_arithmetic_dataset_dict(8, 0, 0, seed=3, high=9)["train"]
    sft = make_arithmetic_sft_dataset(rl)
    model = build_llama(tokenizer)
    seen = set()
    model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda m, a, out: seen.add((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), out.dtype)))
    config = ESParallelAveragingConfig(
        output_dir=str(tmp_path / "pa"), max_steps=1, population_size=4, antithetic=True, prompt_batch_size=2,
        max_completion_length=4, sigma=0.1, learning_rate=0.05, noise_table_size=1 << 20, report_to="none",
        save_strategy="no", disable_tqdm=True, seed=0, sft_learning_rate=1e-2, sft_per_device_train_batch_size=4,
        bf16=True, use_cpu=True)
    ESParallelAveragingTrainer(model, code_reward, args=config, train_dataset=rl, sft_dataset=sft,
                               processing_class=tokenizer).train()
    assert seen == {(False, True, torch.bfloat16), (True, True, torch.bfloat16)}  # rollouts, SFT step


def test_hyper_es_fitness_and_evaluate_run_under_one_precision(tmp_path, tokenizer):
    """Hyper-ES never prepares its model: with bf16 its candidates' fitness and evaluate() run under accelerate's
    autocast (before, neither did, and bf16=True changed nothing)."""
    from peft import LoraConfig, get_peft_model

    from trl_es.merging.lora_delta import LoraDeltaSet
    from trl_es.trainer.hyper_es.hyper_es_trainer import HyperESTrainer

    model = build_llama(tokenizer)
    adapters = []
    for k in range(2):
        torch.manual_seed(100 + k)
        adapter = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                                                   init_lora_weights=False))
        adapter.save_pretrained(tmp_path / f"adapter_{k}")
        adapters.append(str(tmp_path / f"adapter_{k}"))
    phase, seen = {"now": "fitness"}, {}
    model.lm_head.register_forward_hook(
        lambda m, a, out: seen.setdefault(phase["now"], set()).add((torch.is_autocast_enabled("cpu"), out.dtype)))
    args = HyperESConfig(output_dir=str(tmp_path / "hyper"), report_to="none", use_cpu=True, bf16=True,
                         max_generations=1, population_size=2, final_genome="best", prompt_batch_size=2,
                         max_completion_length=3, disable_tqdm=True, seed=0)
    trainer = HyperESTrainer(model, LoraDeltaSet.from_adapters(model, adapters), code_reward, args=args,
                             train_dataset=prompts(), eval_dataset=prompts(2), processing_class=tokenizer)
    trainer.train()
    phase["now"] = "evaluate"
    trainer.evaluate()
    assert seen == {"fitness": {(True, torch.bfloat16)}, "evaluate": {(True, torch.bfloat16)}}


@pytest.mark.parametrize("config_class", [ESConfig, HyperESConfig])
def test_fp16_on_the_cpu_is_refused_by_name(tmp_path, config_class):
    """accelerate does not apply fp16 mixed precision on the CPU: every forward would stay fp32 under fp16=True."""
    with pytest.raises(ValueError, match=r"^fp16=True is not applied on the CPU .* use bf16=True"):
        config_class(output_dir=str(tmp_path), report_to=[], use_cpu=True, fp16=True)
    assert config_class(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=True).bf16 is True


# ---------------------------------------------------------------------------------------------- derived fields
@pytest.fixture
def four_processes(monkeypatch):
    """ESConfig as it is built in each of 4 processes (the world size accelerate reports)."""
    monkeypatch.setattr(ESConfig, "world_size", property(lambda self: 4))


@pytest.mark.parametrize("config_class", [ESConfig, ESParallelAveragingConfig])
def test_per_device_train_batch_size_that_contradicts_prompt_batch_size_is_refused(tmp_path, four_processes,
                                                                                    config_class):
    """16 completions per process on 4 processes (num_generations=1) are 64 prompts, not prompt_batch_size=32."""
    message = (r"^prompt_batch_size=32 contradicts GRPO's batch fields, per_device_train_batch_size=16 x 4 processes x "
               r"gradient_accumulation_steps=1 / num_generations=1 = 64 prompts per optimizer step\. Set "
               r"prompt_batch_size alone \(ES's prompts per iteration\) or GRPO's batch fields alone, or make them "
               r"agree\.$")
    with pytest.raises(ValueError, match=message):
        config_class(output_dir=str(tmp_path), report_to=[], prompt_batch_size=32, per_device_train_batch_size=16)
    assert config_class(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=16).prompt_batch_size == 64


def test_per_device_train_batch_size_unset_or_equal_is_accepted_silently(tmp_path, four_processes):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either
        unset = ESConfig(output_dir=str(tmp_path), report_to=[], prompt_batch_size=32)
        same = ESConfig(output_dir=str(tmp_path), report_to=[], prompt_batch_size=32, per_device_train_batch_size=8)
    assert unset.per_device_train_batch_size == same.per_device_train_batch_size == 8
    # a config rebuilt from a built one's fields (same world size) is accepted
    assert ESConfig(**{**same.to_dict(), "report_to": []}).per_device_train_batch_size == 8


def test_per_device_train_batch_size_on_one_process(tmp_path):
    assert ESConfig(output_dir=str(tmp_path), report_to=[]).per_device_train_batch_size == 8  # prompt_batch_size
    args = ESConfig(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=2)
    assert (args.prompt_batch_size, args.per_device_train_batch_size) == (2, 2)  # 2 completions, 1 each


def test_per_device_train_batch_size_on_the_command_line_is_mapped(tmp_path):
    from trl_es.arguments import TrlESParser

    (args,) = TrlESParser((ESConfig,)).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--per_device_train_batch_size", "16", "--num_generations", "4"])
    assert (args.prompt_batch_size, args.per_device_train_batch_size) == (4, 4)


@pytest.mark.parametrize("value, prompts", [(2, 16), (4, 32)])
def test_gradient_accumulation_steps_is_mapped_and_then_one(tmp_path, value, prompts):
    """GRPO's per_device_train_batch_size default 8 x 1 process x gradient_accumulation_steps / num_generations=1."""
    args = ESConfig(output_dir=str(tmp_path), report_to=[], gradient_accumulation_steps=value)
    assert (args.prompt_batch_size, args.gradient_accumulation_steps) == (prompts, 1)
    assert ESConfig(output_dir=str(tmp_path), report_to=[], gradient_accumulation_steps=1).gradient_accumulation_steps == 1
