"""GRPOTrainer parity of model loading and the trainer constructor (issue 42, classes 4, 5, 6 and 11).

4. ``chat_template_kwargs`` reach the reward model's chat template (GRPO renders the reward model's input with
   ``apply_chat_template(..., **chat_template_kwargs)``).
5. A policy given by name loads as GRPOTrainer loads it: float32 unless ``model_init_kwargs`` sets a ``dtype``
   (TRL's ``create_model_from_path``); a reward model given by name/path gets ``model_init_kwargs`` (as GRPO: passed
   whole, so without a ``dtype`` transformers' ``"auto"``).
6. A ``PeftModel`` together with a ``peft_config`` is refused with GRPO's ValueError (it would be wrapped twice).
11. GRPOTrainer's ``quantization_config`` argument: TRL's ``trl/scripts/grpo.py`` (``trl grpo --config ...``) passes
    ``quantization_config=get_quantization_config(model_args)`` to the trainer; ``None`` is accepted, a real config
    without a ``peft_config`` is refused by name (with one, QLoRA: tests/trainer/test_quantized.py).
"""

import copy
import inspect
import json

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from tiny import CHATML_TEMPLATE, build_llama, build_reward_model, build_tokenizer
from transformers import BitsAndBytesConfig

from trl_es import ESConfig, ESTrainer
from trl_es.models import load_policy, policy_init_kwargs
from trl_es.rollout import RewardScorer

SMALL_TABLE = 1 << 20


def es_args(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path / "out"), max_steps=1, population_size=2, prompt_batch_size=2,
                    max_completion_length=3, sigma=0.02, learning_rate=0.02, report_to=[], save_strategy="no",
                    noise_table_size=SMALL_TABLE, disable_tqdm=True, seed=0)
    defaults.update(kwargs)
    return ESConfig(**defaults)


def length_reward(completions, **kwargs):
    return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]


def chat_prompts(n=2):
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"Say {i}"}]} for i in range(n)])


def record_inputs(reward_model, tokenizer) -> list[str]:
    """The texts the reward model is run on (its input ids decoded, padding cut), appended on every forward."""
    seen = []

    def hook(module, args, kwargs):
        for ids, mask in zip(kwargs["input_ids"], kwargs["attention_mask"], strict=True):
            seen.append(tokenizer.decode(ids[mask.bool()]))

    reward_model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


# ------------------------------------------------------------------------------------ 4. chat_template_kwargs
#: Qwen3's switch, where a reward model sees it: enable_thinking=False marks the rendered conversation.
THINKING_TEMPLATE = ("{% if enable_thinking is defined and enable_thinking is false %}{{ '[no-think]' }}{% endif %}"
                     + CHATML_TEMPLATE)
#: Another template and another keyword: a rubric named by the caller.
RUBRIC_TEMPLATE = "{% if rubric is defined %}{{ 'rubric=' + rubric + '\n' }}{% endif %}" + CHATML_TEMPLATE


def reward_tokenizer(template):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize(("template", "kwargs", "marker"), [
    (THINKING_TEMPLATE, {"enable_thinking": False}, "[no-think]"),
    (RUBRIC_TEMPLATE, {"rubric": "strict"}, "rubric=strict\n"),
])
def test_scorer_renders_the_reward_model_input_with_chat_template_kwargs(template, kwargs, marker):
    tokenizer = reward_tokenizer(template)
    model = build_reward_model(tokenizer)
    seen = record_inputs(model, tokenizer)
    rows = [{"prompt": [{"role": "user", "content": "Say 1"}]}] * 2
    completions = [[{"role": "assistant", "content": "one"}], [{"role": "assistant", "content": "1"}]]
    RewardScorer([model], reward_processing_classes=[tokenizer], chat_template_kwargs=kwargs).score(
        rows, completions, [[1], [2]])
    # GRPO's text: trl.data_utils.apply_chat_template({"messages": prompt + completion}, ..., **chat_template_kwargs)
    expected = [tokenizer.apply_chat_template(rows[0]["prompt"] + c, tokenize=False, **kwargs) for c in completions]
    assert seen == expected
    assert all(text.startswith(marker) for text in seen)
    seen.clear()
    RewardScorer([model], reward_processing_classes=[tokenizer]).score(rows, completions, [[1], [2]])
    assert seen and not any(marker in text for text in seen)  # without the kwargs, the template's other branch


@pytest.mark.parametrize(("template", "kwargs", "marker"), [
    (THINKING_TEMPLATE, {"enable_thinking": False}, "[no-think]"),
    (RUBRIC_TEMPLATE, {"rubric": "lenient"}, "rubric=lenient\n"),
])
def test_train_passes_chat_template_kwargs_to_the_reward_model(tmp_path, tokenizer, template, kwargs, marker):
    reward_tok = reward_tokenizer(template)
    model = build_reward_model(reward_tok)
    seen = record_inputs(model, reward_tok)
    trainer = ESTrainer(build_llama(tokenizer), [model, length_reward],
                        args=es_args(tmp_path, chat_template_kwargs=kwargs), train_dataset=chat_prompts(),
                        processing_class=tokenizer, reward_processing_classes=[reward_tok, None])
    trainer.train()
    assert len(seen) == 2 * 2  # 2 members x 2 prompts
    assert all(text.startswith(marker) and "<|im_start|>user\nSay " in text for text in seen)


# ------------------------------------------------------------------------------------ 5. model loading
@pytest.fixture(scope="module")
def bf16_policy_dir(tmp_path_factory):
    """A tiny Llama stored in bfloat16 (config dtype bfloat16), with its tokenizer."""
    tokenizer = build_tokenizer()
    path = tmp_path_factory.mktemp("bf16-policy")
    build_llama(tokenizer, dtype=torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    return str(path)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A tiny sequence-classification reward model stored in bfloat16, with its tokenizer."""
    tokenizer = build_tokenizer()
    path = tmp_path_factory.mktemp("bf16-reward-model")
    build_reward_model(tokenizer, torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_policy_by_name_loads_in_float32_as_grpo(tmp_path, bf16_policy_dir):
    """No dtype: float32, as GRPOTrainer (TRL's create_model_from_path), not the checkpoint's bfloat16."""
    from trl.trainer.utils import create_model_from_path

    grpo = create_model_from_path(bf16_policy_dir)  # what GRPOTrainer loads a policy given by name with
    trainer = ESTrainer(bf16_policy_dir, length_reward, args=es_args(tmp_path), train_dataset=chat_prompts())
    assert grpo.dtype == trainer.model.dtype == torch.float32
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    for (name, ours), theirs in zip(trainer.model.state_dict().items(), grpo.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs), name  # the same weights: the bf16 values, exactly, in float32


@pytest.mark.parametrize(("dtype", "expected"), [
    ("bfloat16", torch.bfloat16), ("auto", torch.bfloat16), (torch.float32, torch.float32), ("float32", torch.float32),
])
def test_policy_explicit_dtype_is_kept(tmp_path, bf16_policy_dir, dtype, expected):
    from trl.trainer.utils import create_model_from_path

    args = es_args(tmp_path, model_init_kwargs={"dtype": dtype})
    trainer = ESTrainer(bf16_policy_dir, length_reward, args=args, train_dataset=chat_prompts())
    assert trainer.model.dtype == create_model_from_path(bf16_policy_dir, dtype=dtype).dtype == expected


def test_invalid_dtype_is_refused_with_grpos_message():
    with pytest.raises(ValueError, match="^Invalid `dtype` passed to the config.*but got float64"):
        policy_init_kwargs({"dtype": "float64"})
    assert policy_init_kwargs(None) == {"dtype": torch.float32}
    assert policy_init_kwargs({"dtype": None, "revision": "main"}) == {"dtype": None, "revision": "main"}


def test_embedded_alias_and_a_float32_checkpoint_load_as_before(tiny_model_dir):
    """A float32 checkpoint (the embedded model's cache is one) loads in float32 both ways: the old "auto" default and
    the new float32 default give the same tensors."""
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="auto")
    new = load_policy(tiny_model_dir)
    assert old.dtype == new.dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(old.state_dict().values(), new.state_dict().values(), strict=True))


@pytest.mark.parametrize(("init_kwargs", "expected"), [
    ({"dtype": "float32"}, torch.float32),
    ({"dtype": torch.float16}, torch.float16),
    (None, torch.bfloat16),  # as GRPO: model_init_kwargs passed whole, so transformers' "auto" (the stored dtype)
])
def test_reward_model_by_path_gets_model_init_kwargs_as_grpo(tmp_path, tokenizer, reward_model_dir, init_kwargs,
                                                              expected):
    from trl import GRPOConfig, GRPOTrainer

    trainer = ESTrainer(build_llama(tokenizer), reward_model_dir, train_dataset=chat_prompts(),
                        args=es_args(tmp_path, model_init_kwargs=init_kwargs), processing_class=tokenizer)
    grpo = GRPOTrainer(build_llama(tokenizer), reward_model_dir, train_dataset=chat_prompts(),
                       args=GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=2,
                                       num_generations=2, report_to=[], max_completion_length=4, use_cpu=True,
                                       model_init_kwargs=copy.deepcopy(init_kwargs)),
                       processing_class=tokenizer)
    assert trainer.reward_scorer.reward_funcs[0].dtype == grpo.reward_funcs[0].dtype == expected


# ------------------------------------------------------------------------------------ 6. PeftModel + peft_config
def test_peft_model_with_peft_config_is_refused_as_grpo(tmp_path, tokenizer):
    from trl import GRPOConfig, GRPOTrainer

    def wrapped():
        return get_peft_model(build_llama(tokenizer), LoraConfig(target_modules=["q_proj"]))

    message = "^You passed a `PeftModel` instance together with a `peft_config` to the trainer"
    with pytest.raises(ValueError, match=message):
        ESTrainer(wrapped(), length_reward, args=es_args(tmp_path), train_dataset=chat_prompts(),
                  processing_class=tokenizer, peft_config=LoraConfig(target_modules=["v_proj"]))
    with pytest.raises(ValueError, match=message):
        GRPOTrainer(wrapped(), length_reward, train_dataset=chat_prompts(), processing_class=tokenizer,
                    args=GRPOConfig(output_dir=str(tmp_path / "grpo"), report_to=[], use_cpu=True),
                    peft_config=LoraConfig(target_modules=["v_proj"]))


@pytest.mark.parametrize("seed", [0, 7])
def test_peft_adapter_init_is_seeded_by_args_seed_as_grpo(tmp_path, tokenizer, seed):
    """GRPOTrainer calls set_seed(args.seed) before it builds the model: the random LoRA init is the seed's, whatever
    the global RNG did before the constructor."""
    from trl import GRPOConfig, GRPOTrainer

    def lora_a(trainer):
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_A" in n}

    torch.manual_seed(123)
    ours = ESTrainer(build_llama(tokenizer), length_reward, args=es_args(tmp_path, seed=seed),
                     train_dataset=chat_prompts(), processing_class=tokenizer, peft_config=LoraConfig())
    torch.manual_seed(456)
    grpo = GRPOTrainer(build_llama(tokenizer), length_reward, train_dataset=chat_prompts(), processing_class=tokenizer,
                       args=GRPOConfig(output_dir=str(tmp_path / "grpo"), report_to=[], use_cpu=True, seed=seed,
                                       per_device_train_batch_size=2, num_generations=2),
                       peft_config=LoraConfig())
    ours, theirs = lora_a(ours), lora_a(grpo)
    assert ours and ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)


def test_peft_config_of_the_wrong_type_is_refused_as_grpo(tmp_path, tokenizer):
    with pytest.raises(TypeError, match=r"^`peft_config` must be a `peft.PeftConfig` instance.*got dict"):
        ESTrainer(build_llama(tokenizer), length_reward, args=es_args(tmp_path), train_dataset=chat_prompts(),
                  processing_class=tokenizer, peft_config={"r": 8})


def test_peft_model_without_peft_config_trains_one_adapter_that_reloads(tmp_path, tokenizer):
    base = build_llama(tokenizer)
    pristine = copy.deepcopy(base)
    model = get_peft_model(base, LoraConfig(target_modules=["q_proj"], init_lora_weights=False))
    trainer = ESTrainer(model, length_reward, args=es_args(tmp_path), train_dataset=chat_prompts(),
                        processing_class=tokenizer)
    assert set(trainer.model.peft_config) == {"default"}
    assert all("lora_" in e.name for e in trainer.es_params.entries)
    trainer.train()
    trainer.save_model(str(tmp_path / "adapter"))
    reloaded = PeftModel.from_pretrained(pristine, str(tmp_path / "adapter"))
    ours = {n: p for n, p in trainer.model.named_parameters()}
    for name, param in reloaded.named_parameters():
        assert torch.equal(param, ours[name]), name


# ------------------------------------------------------------------------------------ 11. quantization_config
def test_constructor_takes_grpos_quantization_config_in_its_place():
    from trl import GRPOTrainer

    grpo = list(inspect.signature(GRPOTrainer.__init__).parameters)
    ours = list(inspect.signature(ESTrainer.__init__).parameters)
    assert ours == grpo  # the same names in the same order: tools, rollout_func, environment_factory too


@pytest.mark.parametrize("where", ["argument", "model_init_kwargs"])
def test_a_real_quantization_config_is_refused_by_name(tmp_path, tiny_model_dir, where):
    config = BitsAndBytesConfig(load_in_4bit=True)
    kwargs = {"quantization_config": config} if where == "argument" else {}
    args = es_args(tmp_path, model_init_kwargs={"quantization_config": config} if where != "argument" else None)
    with pytest.raises(ValueError, match=r"^quantization_config=BitsAndBytesConfig\(load_in_4bit=True\) needs a "
                                         r"peft_config: ESTrainer trains a quantized base through a PEFT adapter"):
        ESTrainer(tiny_model_dir, length_reward, args=args, train_dataset=chat_prompts(), **kwargs)


def test_quantization_config_in_both_places_is_refused_as_grpo(tmp_path, tiny_model_dir):
    args = es_args(tmp_path, model_init_kwargs={"quantization_config": None})
    with pytest.raises(ValueError, match="^You set `quantization_config` both as a trainer argument and in"):
        ESTrainer(tiny_model_dir, length_reward, args=args, train_dataset=chat_prompts(),
                  quantization_config=BitsAndBytesConfig(load_in_8bit=True))


def test_gspo_style_model_init_kwargs_and_a_none_quantization_config_load(tmp_path, tiny_model_dir, tokenizer):
    """TRL's examples/scripts/gspo.py (an older version) puts ``quantization_config=None, device_map=None`` into
    ``model_init_kwargs``; grpo.py passes ``quantization_config=None`` to the trainer. Both load and train."""
    init_kwargs = dict(revision=None, attn_implementation=None, dtype=None, device_map=None, quantization_config=None)
    trainer = ESTrainer(tiny_model_dir, length_reward, args=es_args(tmp_path, model_init_kwargs=init_kwargs),
                        train_dataset=chat_prompts(), quantization_config=None)
    trainer.train()
    assert trainer.state.global_step == 1


def test_trl_grpo_script_runs_with_the_es_classes_swapped_in(tmp_path, monkeypatch, tiny_model_dir, reward_model_dir):
    """``trl grpo --config recipe.yaml``: TRL's own ``trl/scripts/grpo.py`` main, parsed from a YAML recipe with
    ``ESConfig`` in place of ``GRPOConfig`` and run with ``ESTrainer`` in place of ``GRPOTrainer``. The script builds
    ``model_init_kwargs`` from ``ModelConfig`` and passes ``quantization_config=get_quantization_config(model_args)``
    and ``peft_config=get_peft_config(model_args)`` to the trainer (before issue 42: TypeError on
    ``quantization_config``). A LoRA run with a reward model by path, and the same recipe with ``load_in_4bit``
    without ``use_peft`` refused by name (with it: tests/examples/test_grpo_scripts.py)."""
    import trl
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser
    from trl.scripts import grpo

    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": [{"role": "user", "content": f"Say {i}"}]} for i in range(2)]
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = {
        "model_name_or_path": tiny_model_dir, "dataset_name": str(data), "reward_funcs": ["think_format_reward"],
        "reward_model_name_or_path": reward_model_dir, "use_peft": True, "lora_target_modules": ["q_proj", "v_proj"],
        "output_dir": str(tmp_path / "out"), "max_steps": 1, "population_size": 2, "prompt_batch_size": 2,
        "max_completion_length": 3, "report_to": "none", "save_strategy": "no", "noise_table_size": SMALL_TABLE,
        "disable_tqdm": True,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    parser = TrlParser((grpo.GRPOScriptArguments, ESConfig, ModelConfig, DatasetMixtureConfig))
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(
        ["--config", str(path)], fail_with_unknown_args=False)
    assert model_args.dtype == "float32"  # ModelConfig's default, into model_init_kwargs
    monkeypatch.setattr(trl, "GRPOTrainer", ESTrainer)  # grpo.main imports it from trl when it runs
    grpo.main(script_args, training_args, model_args, dataset_args)
    assert training_args.model_init_kwargs["dtype"] == "float32"
    saved = PeftModel.from_pretrained(build_llama(build_tokenizer()), str(tmp_path / "out"))
    assert set(saved.peft_config["default"].target_modules) == {"q_proj", "v_proj"}

    model_args.load_in_4bit, model_args.use_peft = True, False
    training_args.model_init_kwargs = None
    with pytest.raises(ValueError, match=r"^quantization_config=BitsAndBytesConfig\(load_in_4bit=True\) needs a "
                                         r"peft_config"):
        grpo.main(script_args, training_args, model_args, dataset_args)


# ------------------------------------------------------------------------------------ the trl-es command line
@pytest.mark.parametrize(("dtype", "expected"), [("float32", torch.float32), ("auto", torch.bfloat16),
                                                 ("bfloat16", torch.bfloat16)])
def test_cli_loads_modelconfig_dtype_as_trls_grpo_script(bf16_policy_dir, dtype, expected):
    """``trl-es train|eval --dtype``: ModelConfig's dtype as TRL's grpo.py uses it ("auto": the stored dtype)."""
    from trl import ModelConfig

    from trl_es.cli.loading import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(ModelConfig(model_name_or_path=bf16_policy_dir, dtype=dtype))
    assert model.dtype == expected


@pytest.mark.parametrize("flag", ["load_in_4bit", "load_in_8bit"])
def test_cli_refuses_quantized_loading_without_use_peft_by_name(tiny_model_dir, flag):
    from trl import ModelConfig

    from trl_es.cli.loading import load_model_and_tokenizer

    with pytest.raises(ValueError, match=rf"^quantization_config=BitsAndBytesConfig\({flag}=True\) needs a "
                                         r"peft_config"):
        load_model_and_tokenizer(ModelConfig(model_name_or_path=tiny_model_dir, **{flag: True}))


# ------------------------------------------------------------------------------------ Hyper-ES loads the same way
@pytest.mark.parametrize(("init_kwargs", "expected"), [(None, torch.float32), ({"dtype": "auto"}, torch.bfloat16)])
def test_hyper_es_loads_a_model_by_path_as_grpo(tmp_path, bf16_policy_dir, init_kwargs, expected):
    from transformers import AutoModelForCausalLM

    from trl_es import HyperESConfig, HyperESTrainer

    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(bf16_policy_dir),
                             LoraConfig(target_modules=["q_proj"], init_lora_weights=False))
    adapter.save_pretrained(str(tmp_path / "a"))
    args = HyperESConfig(output_dir=str(tmp_path / "out"), report_to=[], population_size=4, max_steps=1,
                         model_init_kwargs=init_kwargs)
    trainer = HyperESTrainer(bf16_policy_dir, [str(tmp_path / "a")], args=args, fitness_fn=lambda model, genome: 0.0)
    assert trainer.model.dtype == expected
