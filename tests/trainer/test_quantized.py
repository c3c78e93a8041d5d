"""ES on a quantized base (issue 60): ``quantization_config`` with a ``peft_config`` (QLoRA's loading path).

The base loads with bitsandbytes (4-bit NF4/FP4, 8-bit; bitsandbytes >= 0.50 runs them on the CPU) and stays frozen:
its state dict ends bitwise as it was loaded. ES perturbs the fp32 LoRA tensors only: members apply and restore
bitwise, a member is bitwise the one written on an unquantized base, stacked low-rank members equal their
materialized adapters; evaluate, save_model, checkpoints, resume, load_best_model_at_end and replay are bitwise, and
the seed log's header records the quantization config. Refused by name: a quantized base without an adapter (the
trainer argument, ``model_init_kwargs``, a model instance, the command line), vLLM, ZeRO-3, and a resume or replay
on a base quantized otherwise.
"""

import math
import os
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from tiny import build_vllm_llama, content_reward
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, set_seed

from trl_es import ESConfig, ESTrainer, replay
from trl_es.es import SEED_LOG_NAME, SeedLog
from trl_es.quantized import HEADER_KEY, prepare_quantized_training, quantization_config_from_header, quantization_of

bnb = pytest.importorskip("bitsandbytes")

SMALL_TABLE = 1 << 20
NF4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
FP4 = dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.float32)
INT8 = dict(load_in_8bit=True)
QUANTS = {"nf4": NF4, "fp4": FP4, "int8": INT8}
LORA = dict(target_modules=["q_proj", "v_proj"], init_lora_weights=False, r=4)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tokenizer):
    """A tiny Llama whose linear layers bitsandbytes quantizes on the CPU (in_features 64 and 128: whole blocks)."""
    path = tmp_path_factory.mktemp("tiny-llama-64")
    build_vllm_llama(tokenizer, tie_word_embeddings=False).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def prompts(n=4):
    return Dataset.from_list([{"prompt": f"Say {i}{'!' * i}"} for i in range(n)])


def es_args(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path / "out"), max_steps=2, population_size=4, prompt_batch_size=2,
                    max_completion_length=4, sigma=0.05, learning_rate=0.05, report_to=[], save_strategy="no",
                    noise_table_size=SMALL_TABLE, disable_tqdm=True, seed=0)
    defaults.update(kwargs)
    return ESConfig(**defaults)


def trainer_on(base_dir, tmp_path, quant="nf4", lora=LORA, **kwargs):
    """An ESTrainer on ``base_dir`` loaded as ``quant`` (None: unquantized) with a LoRA adapter."""
    config = BitsAndBytesConfig(**QUANTS[quant]) if quant else None
    return ESTrainer(base_dir, content_reward, args=es_args(tmp_path, **kwargs), train_dataset=prompts(),
                     eval_dataset=prompts(2), quantization_config=config, peft_config=LoraConfig(**lora))


def base_state(model) -> dict[str, torch.Tensor]:
    """The frozen base as it computes: every parameter but the adapter's (the quantized codes as stored) and the
    4-bit absmax / 8-bit row scales, read after one forward (bitsandbytes' CPU kernel repacks 4-bit weights once, at
    the first forward; ``state_dict()`` would unpack them again)."""
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    state = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if getattr(weight, "quant_state", None) is not None:
            state[name + ".absmax"] = weight.quant_state.absmax.clone()
        scales = getattr(getattr(module, "state", None), "SCB", None)  # an 8-bit layer's row scales
        if scales is not None:
            state[name + ".SCB"] = scales.clone()
    assert any(k.endswith((".absmax", ".SCB")) for k in state)  # the quantized layers were read
    return state


def adapter(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def assert_equal_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def initial_peft_model(base_dir, quant, seed=0, lora=LORA):
    """The run's starting point, rebuilt as the trainer built it: the base (quantized as ``quant``), then the adapter
    initialized under ``set_seed(seed)``."""
    set_seed(seed)
    config = BitsAndBytesConfig(**QUANTS[quant]) if quant else None
    base = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=config, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(**lora))


# ------------------------------------------------------------------------------------------- loading and the build
@pytest.mark.parametrize("quant", ["nf4", "fp4", "int8"])
def test_base_loads_quantized_and_only_the_fp32_adapter_is_trained(base_dir, tmp_path, quant):
    trainer = trainer_on(base_dir, tmp_path, quant)
    model = trainer.model
    layer = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    assert isinstance(layer, bnb.nn.Linear8bitLt if quant == "int8" else bnb.nn.Linear4bit)
    names = [e.name for e in trainer.es_params.entries]
    assert len(names) == 8 and all(".lora_A." in n or ".lora_B." in n for n in names)  # 2 layers x (q, v) x (A, B)
    assert all(e.param.dtype == torch.float32 and e.master.dtype == torch.float32 for e in trainer.es_params.entries)
    header = trainer.seed_log.header[HEADER_KEY]
    assert header["quant_method"] == "bitsandbytes" and header["load_in_4bit"] is (quant != "int8")
    assert header["bnb_4bit_quant_type"] == ("nf4" if quant == "nf4" else "fp4")
    assert quantization_config_from_header(trainer.seed_log.header).to_dict() == quantization_of(model).to_dict()


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_training_moves_the_adapter_and_leaves_the_base_bitwise(base_dir, tmp_path, quant):
    trainer = trainer_on(base_dir, tmp_path, quant)
    base, start = base_state(trainer.model), adapter(trainer.model)
    trainer.train()
    assert_equal_tensors(base_state(trainer.model), base)
    moved = adapter(trainer.model)
    assert all(not torch.equal(moved[n], start[n]) for n in start), "every adapter tensor moves"


def test_unquantized_runs_keep_their_seed_log_header(base_dir, tmp_path):
    trainer = trainer_on(base_dir, tmp_path, quant=None)
    assert HEADER_KEY not in trainer.seed_log.header  # a run on an unquantized base writes the header it always did


# ------------------------------------------------------------------------------------------- members
@pytest.mark.parametrize("quant", ["nf4", "fp4", "int8"])
def test_members_apply_and_restore_bitwise_on_a_quantized_base(base_dir, tmp_path, quant):
    """Sequential members: written into the fp32 adapter, restored bitwise from the fp32 master, base untouched; the
    member's adapter is bitwise the one the same member writes on the unquantized base."""
    trainer = trainer_on(base_dir, tmp_path, quant)
    plain = trainer_on(base_dir, tmp_path / "plain", quant=None)
    model, start, base = trainer.model, adapter(trainer.model), base_state(trainer.model)
    assert_equal_tensors(start, adapter(plain.model))  # the same seeded adapter init on both bases
    inputs = trainer.processing_class(["Say 3"], return_tensors="pt")
    with torch.no_grad():
        before = model(**inputs).logits
    for member in trainer.strategy.ask(0)[:2]:
        with trainer.strategy.apply([member], model):
            applied = adapter(model)
            with torch.no_grad():
                logits = model(**inputs).logits
            with plain.strategy.apply([member], plain.model):
                assert_equal_tensors(adapter(plain.model), applied)
        assert all(not torch.equal(applied[n], start[n]) for n in start)
        assert (logits - before).abs().max() > 1e-4  # the member changes what the quantized model computes
        assert_equal_tensors(adapter(model), start)
        with torch.no_grad():
            assert torch.equal(model(**inputs).logits, before)
    assert_equal_tensors(base_state(model), base)


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_stacked_lowrank_members_equal_their_materialized_adapters(base_dir, tmp_path, quant):
    """population_backend='batched_lowrank' composes with bitsandbytes layers: its hooks sit on the adapter's own
    nn.Linear layers, so each row block computes with ``lora + sign * sigma / sqrt(r) * A_i B_i^T`` (EGGROLL)."""
    from oracles import full_noise

    trainer = trainer_on(base_dir, tmp_path, quant, population_backend="batched_lowrank", noise_rank=2)
    model, start = trainer.model, adapter(trainer.model)
    members, sigma = trainer.strategy.ask(0)[:2], trainer.args.sigma
    inputs = trainer.processing_class(["Say 3", "Say 12!"], return_tensors="pt", padding=True, padding_side="left")
    stacked = {k: v.repeat(len(members), 1) for k, v in inputs.items()}
    with torch.no_grad(), trainer.strategy.apply(members, model):
        logits = model(**stacked).logits
    assert_equal_tensors(adapter(model), start)  # the weights are never written
    named = dict(model.named_parameters())
    for k, member in enumerate(members):
        with torch.no_grad():
            for e in trainer.es_params.entries:  # the member written densely into the adapter, in float64
                out_features, in_features = e.param.shape
                a = full_noise(trainer.noise, member.seed, e.name + ".lowrank_A", (out_features, 2)).double()
                b = full_noise(trainer.noise, member.seed, e.name + ".lowrank_B", (in_features, 2)).double()
                named[e.name].add_((member.sign * sigma / math.sqrt(2) * (a @ b.T)).float())
            expected = model(**inputs).logits
            for name, value in start.items():
                named[name].copy_(value)
        torch.testing.assert_close(logits[2 * k: 2 * k + 2], expected, atol=2e-5, rtol=1e-4)
        assert (expected - logits[2 * (1 - k): 2 * (1 - k) + 2]).abs().max() > 1e-4  # the members differ


# ------------------------------------------------------------------------------------------- every path
@pytest.mark.parametrize("backend", ["sequential", "batched_lowrank"])
def test_save_model_and_replay_rebuild_the_adapter_bitwise(base_dir, tmp_path, backend):
    trainer = trainer_on(base_dir, tmp_path, "nf4", population_backend=backend)
    trainer.train()
    trainer.save_model()
    trained = adapter(trainer.model)
    out = trainer.args.output_dir
    header = SeedLog.load(out).header
    assert header[HEADER_KEY]["bnb_4bit_quant_type"] == "nf4"
    # the saved adapter on a freshly loaded quantized base
    base = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=quantization_config_from_header(header))
    assert_equal_tensors(adapter(PeftModel.from_pretrained(base, out)), trained)
    # replay from the seed log: the initial PeftModel over the base quantized as the header records
    replayed = replay(initial_peft_model(base_dir, "nf4"), out)
    assert_equal_tensors(adapter(replayed), trained)
    card = open(os.path.join(out, "README.md")).read()  # the card's replay snippet loads the recorded base
    assert "quantization_config=config)  # the base, wrapped with its initial PEFT adapter" in card
    assert "quantization_config_from_header(SeedLog.load(\"es_seed_log.jsonl\").header)" in card


@pytest.mark.parametrize(("quant", "named"), [(None, "unquantized"), ("int8", "load_in_8bit=True")])
def test_replay_refuses_a_base_quantized_otherwise(base_dir, tmp_path, quant, named):
    trainer = trainer_on(base_dir, tmp_path, "nf4", max_steps=1)
    trainer.train()
    with pytest.raises(ValueError, match=rf"^replay: the run was trained on a base quantized with "
                                         rf"BitsAndBytesConfig\(load_in_4bit=True\) .*but this model's base is "
                                         rf".*{named}"):
        replay(initial_peft_model(base_dir, quant), trainer.args.output_dir)


@pytest.mark.parametrize("backend", ["sequential", "batched_lowrank"])
def test_resume_is_bitwise_and_refuses_another_base(base_dir, tmp_path, backend):
    full = trainer_on(base_dir, tmp_path / "full", "nf4", population_backend=backend, max_steps=3)
    full.train()
    first = trainer_on(base_dir, tmp_path / "cut", "nf4", population_backend=backend, max_steps=3,
                       save_strategy="steps", save_steps=1)
    first.train()
    assert_equal_tensors(adapter(first.model), adapter(full.model))  # a checkpoint changes nothing the run computes
    checkpoint = os.path.join(first.args.output_dir, "checkpoint-2")
    assert SeedLog.load(checkpoint).header[HEADER_KEY]["load_in_4bit"] is True
    resumed = trainer_on(base_dir, tmp_path / "cut", "nf4", population_backend=backend, max_steps=3)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert_equal_tensors(adapter(resumed.model), adapter(full.model))
    for quant in ("fp4", None):  # fp4: another 4-bit code book; None: the unquantized base
        other = trainer_on(base_dir, tmp_path / "cut", quant, population_backend=backend, max_steps=3)
        with pytest.raises(ValueError, match=r"these settings differ from the checkpoint's: quantization_config "
                                             r"\(the base model's\) \(checkpoint: \{'quant_method': 'bitsandbytes'"):
            other.train(resume_from_checkpoint=checkpoint)


@pytest.mark.parametrize("quant", ["nf4", "fp4"])
def test_saving_leaves_what_the_base_computes_bitwise(base_dir, tmp_path, quant):
    """bitsandbytes' CPU repacking of 4-bit layers is off: its state_dict() round trip would change the logits."""
    trainer = trainer_on(base_dir, tmp_path, quant)
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]])}
    with torch.no_grad():
        before = trainer.model(**inputs).logits
    trainer.save_model()
    with torch.no_grad():
        assert torch.equal(trainer.model(**inputs).logits, before)
    layers = [m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 14 and not any(m.support_avx512bf16_for_cpu for m in layers)  # 2 layers x 7 linears


def test_evaluate_and_load_best_model_at_end(base_dir, tmp_path):
    """evaluate() scores the unperturbed adapter and changes nothing; load_best_model_at_end loads the best
    checkpoint's adapter into the quantized model, bitwise (and its seed log)."""
    trainer = trainer_on(base_dir, tmp_path, "nf4", max_steps=3, eval_strategy="steps", eval_steps=1,
                         save_strategy="steps", save_steps=1, load_best_model_at_end=True,
                         metric_for_best_model="reward", greater_is_better=True)
    start, base = adapter(trainer.model), base_state(trainer.model)
    first, second = ({k: v for k, v in trainer.evaluate().items() if k != "eval_runtime"} for _ in range(2))
    assert first == second and first["eval_num_completions"] == 2 and first["eval_reward"] is not None
    assert_equal_tensors(adapter(trainer.model), start)
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None
    saved = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=BitsAndBytesConfig(**NF4)), best)
    assert_equal_tensors(adapter(trainer.model), adapter(saved))
    assert trainer.seed_log.global_step == int(best.rsplit("-", 1)[1])
    assert_equal_tensors(base_state(trainer.model), base)


# ------------------------------------------------------------------------------------------- refusals
FULL_PARAMETER = (r"needs a peft_config: ESTrainer trains a quantized base through a PEFT adapter only \(QLoRA\), "
                  r"because full-parameter ES perturbs every trained weight in place")


@pytest.mark.parametrize("quant", ["nf4", "int8"])
@pytest.mark.parametrize("where", ["argument", "model_init_kwargs"])
def test_quantization_without_a_peft_config_is_refused_before_loading(base_dir, tmp_path, quant, where, monkeypatch):
    config = BitsAndBytesConfig(**QUANTS[quant])
    bits = "load_in_8bit" if quant == "int8" else "load_in_4bit"
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", None)  # refused before any load
    kwargs = {"quantization_config": config} if where == "argument" else {}
    args = es_args(tmp_path, model_init_kwargs={"quantization_config": config} if where != "argument" else None)
    with pytest.raises(ValueError, match=rf"^quantization_config=BitsAndBytesConfig\({bits}=True\) {FULL_PARAMETER}"):
        ESTrainer(base_dir, content_reward, args=args, train_dataset=prompts(), **kwargs)


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_a_quantized_model_instance_without_an_adapter_is_refused(base_dir, tmp_path, quant):
    model = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=BitsAndBytesConfig(**QUANTS[quant]))
    with pytest.raises(ValueError, match=rf"^a model quantized with quantization_config=BitsAndBytesConfig\(load_in_"
                                         rf"{'8' if quant == 'int8' else '4'}bit=True\) {FULL_PARAMETER}"):
        ESTrainer(model, content_reward, args=es_args(tmp_path), train_dataset=prompts())


def test_a_quantized_peft_model_instance_trains(base_dir, tmp_path):
    """A PeftModel the user wrapped around a 4-bit base: ES trains its adapter (no peft_config needed)."""
    model = initial_peft_model(base_dir, "fp4")
    start = adapter(model)
    trainer = ESTrainer(model, content_reward, args=es_args(tmp_path, max_steps=1), train_dataset=prompts())
    trainer.train()
    assert trainer.seed_log.header[HEADER_KEY]["bnb_4bit_quant_type"] == "fp4"
    assert any(not torch.equal(p, start[n]) for n, p in adapter(model).items())


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_vllm_is_refused_by_name_on_a_quantized_base(base_dir, tmp_path, quant):
    bits = "load_in_8bit" if quant == "int8" else "load_in_4bit"
    with pytest.raises(ValueError, match=rf"^use_vllm=True is not supported with a quantized base \("
                                         rf"BitsAndBytesConfig\({bits}=True\)\): the vLLM engine loads"):
        trainer_on(base_dir, tmp_path, quant, use_vllm=True)


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_zero3_is_refused_by_name_on_a_quantized_base(base_dir, tokenizer, quant):
    model = initial_peft_model(base_dir, quant)
    for stage, refused in ((3, True), (2, False)):
        args = SimpleNamespace(use_vllm=False, deepspeed_plugin=SimpleNamespace(zero_stage=stage))
        if refused:
            with pytest.raises(ValueError, match=r"^DeepSpeed ZeRO-3 is not supported with a quantized base \("
                                                 r"BitsAndBytesConfig\(load_in_"):
                prepare_quantized_training(model, args)
        else:
            prepare_quantized_training(model, args)
    plain = SimpleNamespace(use_vllm=True, deepspeed_plugin=SimpleNamespace(zero_stage=3))
    prepare_quantized_training(build_vllm_llama(tokenizer), plain)  # an unquantized model passes


# ------------------------------------------------------------------------------------------- the command line
@pytest.mark.parametrize(("flag", "layer"), [("load_in_4bit", "Linear4bit"), ("load_in_8bit", "Linear8bitLt")])
def test_cli_loads_a_quantized_base_for_use_peft_and_for_eval(base_dir, flag, layer):
    """``trl-es train --load_in_4bit --use_peft`` (TRL's get_quantization_config: compute dtype = --dtype, float32);
    ``trl-es eval --load_in_4bit`` scores the quantized model as it is, its 4-bit layers computing as in training
    (bitsandbytes' CPU repacking off)."""
    from trl import ModelConfig

    from trl_es.cli.loading import load_model_and_tokenizer

    for use_peft, training in ((True, True), (False, False)):
        model_args = ModelConfig(model_name_or_path=base_dir, use_peft=use_peft, **{flag: True})
        model, _ = load_model_and_tokenizer(model_args, training=training)
        assert type(model.model.layers[1].mlp.down_proj).__name__ == layer
        if flag == "load_in_4bit":
            assert model.config.quantization_config.bnb_4bit_compute_dtype == torch.float32
            assert model.config.quantization_config.bnb_4bit_quant_type == "nf4"  # ModelConfig's default
            layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
            assert len(layers) == 14 and not any(m.support_avx512bf16_for_cpu for m in layers)  # as in training
            model.eval()
            inputs = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]])}
            with torch.no_grad():
                before = model(**inputs).logits
                model.state_dict()  # a repacked layer would compute otherwise after this
                assert torch.equal(model(**inputs).logits, before)
