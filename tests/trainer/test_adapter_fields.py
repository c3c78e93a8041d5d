"""Every LoraConfig field that changes what an adapter does, through Hyper-ES's merge (issue 32, class 7).

An adapter is merged faithfully (``W0 + Delta`` with coefficient 1 equals peft's own ``merge_and_unload()``), or is
refused by name before anything is loaded; the base model is never written, and ``MergeApplier.restore()`` gives
every tensor back bitwise, also after an exception in the middle of an apply.
"""

import copy
import json

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tiny import build_llama, build_qwen2, build_vllm_qwen2

from trl_es.merging import Genome, LoraDeltaSet, MergeApplier, group_modules, save_deltas_as_lora
from trl_es.merging.lora_delta import DenseDelta, LoraFactors

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _peft_adapter(base, seed=0, **fields):
    """A LoRA adapter on a copy of ``base`` whose every trainable tensor is visibly nonzero / moved from the base:
    LoRA factors, and whatever ``fields`` add (modules_to_save copies, biases, trainable token rows)."""
    torch.manual_seed(seed)
    fields = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "init_lora_weights": False, **fields}
    model = get_peft_model(copy.deepcopy(base), LoraConfig(**fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(10.0)
            elif p.requires_grad and "lora_" not in name:  # a tensor the adapter trains in place of the base's
                p.add_(0.1 * torch.randn_like(p))
    return model


def _save(model, path):
    model.save_pretrained(path)
    return str(path)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_bitwise(model, before):
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k


def _unit_genome(delta_set):
    """Coefficient 1 for the single adapter, density 1."""
    groups, module_groups = group_modules(delta_set.module_names, "global")
    return Genome(np.ones((1, 1)), np.ones(1), groups, module_groups, delta_set.adapter_names, "global", seed=0)


def _assert_merges_like_peft(base, path, moved):
    """Merge the adapter at ``path`` with coefficient 1 (alone, and as a genome) and compare every tensor with peft's
    ``merge_and_unload()``; ``moved`` are tensors the merge must change. Then restore and check bitwise."""
    pristine = copy.deepcopy(base)
    reference = PeftModel.from_pretrained(copy.deepcopy(pristine), path).merge_and_unload().state_dict()
    before = _state(base)
    head = base.lm_head
    delta_set = LoraDeltaSet.from_adapters(base, [path])
    _assert_bitwise(base, before)  # reading the adapter wrote nothing into the base
    assert base.lm_head is head  # and swapped no module
    applier = MergeApplier(base, delta_set)
    for apply in (lambda: applier.apply_adapter(0), lambda: applier.apply(_unit_genome(delta_set))):
        apply()
        merged = base.state_dict()
        for key in moved:
            assert not torch.allclose(reference[key], before[key]), key  # the field matters for this input
        for key, value in reference.items():
            torch.testing.assert_close(merged[key], value, rtol=1e-6, atol=1e-6, msg=key)
        applier.restore()
        _assert_bitwise(base, before)
    return delta_set


# ---- honoured: merged like peft's merge_and_unload ----


def test_modules_to_save_lm_head_merges_and_restores(tokenizer, tmp_path):
    """The issue's input: peft's unload() keeps the adapter's lm_head; the merge adds (copy - base) as a delta."""
    base = build_llama(tokenizer)
    path = _save(_peft_adapter(base, modules_to_save=["lm_head"]), tmp_path / "a")
    delta_set = _assert_merges_like_peft(base, path, ["lm_head.weight"])
    assert isinstance(delta_set.factors[0]["lm_head"], DenseDelta)
    assert delta_set.factors[0]["lm_head"].field == "modules_to_save"


def test_modules_to_save_embedding_and_norms(tokenizer, tmp_path):
    base = build_llama(tokenizer)
    adapter = _peft_adapter(base, modules_to_save=["embed_tokens", "norm"])
    # which modules "norm" names is peft's choice (0.21: every name ending in "norm"; 0.22: the module "norm" only);
    # the merge must follow the saved adapter either way
    saved = {name.rsplit(".modules_to_save", 1)[0].removeprefix("base_model.model.")
             for name, _ in adapter.named_parameters() if ".modules_to_save." in name}
    path = _save(adapter, tmp_path / "a")
    layer_norm = "model.layers.1.input_layernorm"
    delta_set = _assert_merges_like_peft(
        base, path, ["model.embed_tokens.weight", "model.norm.weight"]
        + ([f"{layer_norm}.weight"] if layer_norm in saved else []))
    assert {"model.embed_tokens", "model.norm"} <= saved
    assert saved <= set(delta_set.module_names)


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_trained_biases(tokenizer, tmp_path, bias):
    """peft loads trained biases straight into the base model's bias tensors; here they are deltas."""
    base = build_vllm_qwen2(tokenizer)  # q/k/v biases, random
    path = _save(_peft_adapter(base, bias=bias), tmp_path / "a")
    moved = ["model.layers.0.self_attn.q_proj.bias"] + (["model.layers.1.self_attn.k_proj.bias"] * (bias == "all"))
    delta_set = _assert_merges_like_peft(base, path, moved)
    assert delta_set.factors[0]["model.layers.0.self_attn.q_proj.bias"].field == "bias"
    assert ("model.layers.0.self_attn.k_proj.bias" in delta_set.module_names) == (bias == "all")


def test_trainable_token_indices(tokenizer, tmp_path):
    base = build_llama(tokenizer)
    path = _save(_peft_adapter(base, trainable_token_indices=[3, 5, 7]), tmp_path / "a")
    delta_set = _assert_merges_like_peft(base, path, ["model.embed_tokens.weight"])
    rows = delta_set.delta("model.embed_tokens", 0).abs().sum(dim=1).nonzero().flatten().tolist()
    assert rows == [3, 5, 7]


@pytest.mark.parametrize(
    "fields",
    [
        {"use_rslora": True, "rank_pattern": {"v_proj": 2}, "alpha_pattern": {"down_proj": 3}},
        {"layers_to_transform": [1], "exclude_modules": ["model.layers.1.self_attn.v_proj"]},
        {"init_lora_weights": "mica"},  # a LoRA variant with a plain delta (lora_B frozen in training)
    ],
    ids=["rslora_patterns", "layers_exclude", "mica"],
)
def test_scaling_and_selection_fields(tokenizer, tmp_path, fields):
    base = build_llama(tokenizer)
    model = _peft_adapter(base, **fields)
    if fields.get("init_lora_weights") == "mica":  # MiCA starts with A = 0: give it a trained-looking A
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_A" in name:
                    p.normal_(0, 0.5)
    path = _save(model, tmp_path / "a")
    delta_set = _assert_merges_like_peft(base, path, ["model.layers.1.mlp.down_proj.weight"])
    if "layers_to_transform" in fields:
        assert delta_set.module_names == ["model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    # The same adapter given as a PeftModel reads the same deltas.
    from_model = LoraDeltaSet.from_adapters(base, [model])
    assert from_model.module_names == delta_set.module_names
    for name in delta_set.module_names:
        assert torch.equal(from_model.delta(name, 0), delta_set.delta(name, 0)), name


def test_peft_model_input_with_modules_to_save(tokenizer, tmp_path):
    base = build_llama(tokenizer)
    model = _peft_adapter(base, modules_to_save=["lm_head"])
    from_folder = LoraDeltaSet.from_adapters(base, [_save(model, tmp_path / "a")])
    from_model = LoraDeltaSet.from_adapters(base, [model])
    expected = model.base_model.model.lm_head.modules_to_save["default"].weight - base.lm_head.weight
    assert torch.equal(from_model.delta("lm_head", 0), expected.detach())
    for name in from_folder.module_names:
        assert torch.equal(from_model.delta(name, 0), from_folder.delta(name, 0)), name


def test_two_adapters_share_a_replaced_module(tokenizer, tmp_path):
    """One adapter puts LoRA on lm_head, another saves lm_head: one delta name, merged like any other."""
    base = build_llama(tokenizer)
    a = _save(_peft_adapter(base, seed=1, target_modules=["q_proj", "lm_head"]), tmp_path / "lora_head")
    b = _save(_peft_adapter(base, seed=2, modules_to_save=["lm_head"]), tmp_path / "saved_head")
    delta_set = LoraDeltaSet.from_adapters(base, [a, b])
    assert delta_set.module_names.count("lm_head") == 1
    assert isinstance(delta_set.factors[0]["lm_head"], LoraFactors)  # the saved base lm_head adds nothing
    assert isinstance(delta_set.factors[1]["lm_head"], DenseDelta)
    assert delta_set.deltas("lm_head").shape == (2, *base.lm_head.weight.shape)


@pytest.mark.parametrize("tied", [False, True])
def test_lora_on_lm_head_with_saved_embedding_layer(tokenizer, tmp_path, tied):
    """LoRA on lm_head: peft also saves the weight under it (save_embedding_layers) and loads it into the base. Equal
    to the base: nothing more to merge (tied: the LoRA delta changes the shared tensor, as peft's merge does).
    Changed (untied): it is merged as (saved - base) + LoRA delta, as peft's merge_and_unload does."""
    from safetensors.torch import load_file, save_file

    base = build_qwen2(tokenizer) if tied else build_llama(tokenizer)
    path = _save(_peft_adapter(base, target_modules=["q_proj", "lm_head"]), tmp_path / "a")
    if not tied:
        file = tmp_path / "a" / "adapter_model.safetensors"
        state = load_file(file)
        state["base_model.model.lm_head.base_layer.weight"] += 0.1
        save_file(state, file)
    delta_set = _assert_merges_like_peft(base, path, ["lm_head.weight"] + ["model.embed_tokens.weight"] * tied)
    kind = LoraFactors if tied else DenseDelta
    assert isinstance(delta_set.factors[0]["lm_head"], kind)
    assert [n for n in delta_set.module_names if "embed" in n] == []


# ---- refused by name, before anything is loaded ----


def _with_config(path, **fields):
    """Rewrite a saved adapter's config with ``fields`` (the tensors stay those of a plain LoRA adapter)."""
    config_file = path / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config.update(fields)
    config_file.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    "field, value",
    [
        ("lora_bias", True),
        ("target_parameters", ["model.layers.0.mlp.down_proj.weight"]),
        ("use_qalora", True),
        ("layer_replication", [[0, 2], [1, 2]]),
        ("alora_invocation_tokens", [5, 6]),
        ("init_lora_weights", "olora"),
        ("init_lora_weights", "pissa_niter_4"),
        ("init_lora_weights", "corda"),
    ],
)
def test_unrepresentable_fields_are_refused_by_name(tokenizer, tmp_path, field, value):
    base = build_llama(tokenizer)
    _save(_peft_adapter(base), tmp_path / "odd")
    path = _with_config(tmp_path / "odd", **{field: value})
    before = _state(base)
    with pytest.raises(ValueError) as err:
        LoraDeltaSet.from_adapters(base, [path])
    message = str(err.value)
    assert "'odd'" in message and f"{field}={value!r}" in message
    _assert_bitwise(base, before)


@pytest.mark.parametrize("field, value", [("use_dora", True), ("init_lora_weights", "pissa")])
def test_real_dora_and_pissa_adapters_are_refused_before_loading(tokenizer, tmp_path, field, value):
    """A PiSSA adapter loaded by peft rewrites the base weights (W - B0 A0): refused before peft sees the base."""
    base = build_llama(tokenizer)
    model = _peft_adapter(base, **{field: value})
    path = _save(model, tmp_path / "odd")
    before = _state(base)
    for adapter in (path, model):
        with pytest.raises(ValueError, match=f"{field}={value!r}"):
            LoraDeltaSet.from_adapters(base, [adapter], adapter_names=["odd"])
        _assert_bitwise(base, before)


def test_modules_to_save_of_a_tied_weight_is_refused(tokenizer, tmp_path):
    """Tied lm_head / embeddings: writing lm_head would change the embeddings too (peft's merge unties them)."""
    base = build_qwen2(tokenizer)
    assert base.lm_head.weight is base.model.embed_tokens.weight
    path = _save(_peft_adapter(base, modules_to_save=["lm_head"]), tmp_path / "tied")
    with pytest.raises(ValueError, match=r"modules_to_save replaces 'lm_head.weight', which the base model ties"):
        LoraDeltaSet.from_adapters(base, [path])


def test_modules_to_save_of_a_tied_weight_with_ensure_weight_tying(tokenizer, tmp_path):
    """With ensure_weight_tying peft keeps the copies tied and merges both: one delta on the shared tensor."""
    base = build_qwen2(tokenizer)
    path = _save(_peft_adapter(base, modules_to_save=["lm_head"], ensure_weight_tying=True), tmp_path / "tied")
    delta_set = _assert_merges_like_peft(base, path, ["lm_head.weight", "model.embed_tokens.weight"])
    assert [n for n in delta_set.module_names if "embed" in n or "lm_head" in n] == ["model.embed_tokens"]


def test_base_with_peft_layers_is_refused(tokenizer):
    model = _peft_adapter(build_llama(tokenizer))
    with pytest.raises(ValueError, match="base model has a peft layer"):
        LoraDeltaSet.from_adapters(model.base_model.model, [model])


def test_export_refuses_deltas_lora_cannot_carry(tmp_path):
    deltas = {"model.layers.0.mlp.down_proj": torch.ones(4, 6), "model.norm": torch.ones(4)}
    with pytest.raises(ValueError, match=r"\['model.norm'\]"):
        save_deltas_as_lora(deltas, 2, tmp_path / "export")


# ---- MergeApplier: restore bitwise, exceptions leave the weights as they were ----


def _two_adapter_applier(tokenizer, tmp_path):
    base = build_llama(tokenizer)
    paths = [
        _save(_peft_adapter(base, seed=1, modules_to_save=["lm_head", "norm"]), tmp_path / "a"),
        _save(_peft_adapter(base, seed=2), tmp_path / "b"),
    ]
    delta_set = LoraDeltaSet.from_adapters(base, paths)
    groups, module_groups = group_modules(delta_set.module_names, "layer")
    genome = Genome(np.full((len(groups), 2), 0.7), np.full(len(groups), 0.5), groups, module_groups,
                    delta_set.adapter_names, "layer", seed=3)
    return base, MergeApplier(base, delta_set), genome


def test_restore_is_bitwise_for_every_tensor(tokenizer, tmp_path):
    base, applier, genome = _two_adapter_applier(tokenizer, tmp_path)
    before = _state(base)
    applier.apply(genome)
    assert not torch.equal(base.lm_head.weight, before["lm_head.weight"])
    assert not torch.equal(base.model.norm.weight, before["model.norm.weight"])
    applier.restore()
    _assert_bitwise(base, before)


@pytest.mark.parametrize("start", ["base", "genome", "adapter"])
def test_exception_during_apply_leaves_weights_as_they_were(tokenizer, tmp_path, monkeypatch, start):
    base, applier, genome = _two_adapter_applier(tokenizer, tmp_path)
    if start == "genome":
        applier.apply(genome)
    elif start == "adapter":
        applier.apply_adapter(1)
    before, state = _state(base), applier.state
    write, calls = applier._write, []

    def failing_write(name, delta):
        calls.append(name)
        if len(calls) == 5:
            raise RuntimeError("out of memory (simulated)")
        write(name, delta)

    monkeypatch.setattr(applier, "_write", failing_write)
    other = Genome(genome.weights * 1.5, genome.densities, genome.group_names, genome.module_groups,
                   genome.adapter_names, "layer", seed=4)
    with pytest.raises(RuntimeError, match="simulated"):
        applier.apply(other)
    _assert_bitwise(base, before)
    assert applier.state is state
    calls.clear()
    with pytest.raises(RuntimeError, match="simulated"):
        applier.apply_adapter(0)
    _assert_bitwise(base, before)


def test_genome_without_some_delta_is_refused_before_writing(tokenizer, tmp_path):
    base, applier, genome = _two_adapter_applier(tokenizer, tmp_path)
    before = _state(base)
    partial = dict(genome.module_groups)
    del partial["lm_head"]
    bad = Genome(genome.weights, genome.densities, genome.group_names, partial, genome.adapter_names, "layer")
    with pytest.raises(ValueError, match="lm_head"):
        applier.apply(bad)
    _assert_bitwise(base, before)


def test_deltas_on_one_tied_tensor_are_refused(tokenizer):
    base = build_qwen2(tokenizer)
    shape = tuple(base.lm_head.weight.shape)
    delta_set = LoraDeltaSet([{"lm_head": DenseDelta(torch.zeros(shape)),
                               "model.embed_tokens": DenseDelta(torch.zeros(shape))}])
    with pytest.raises(ValueError, match="same tensor"):
        MergeApplier(base, delta_set)


@pytest.mark.parametrize("fields", [{"bias": "all"}, {"modules_to_save": ["input_layernorm"]}], ids=["bias", "norm"])
def test_hyper_es_refuses_a_lora_export_of_dense_vector_deltas_before_any_work(tokenizer, tmp_path, fields):
    """export_lora_rank with deltas a LoRA adapter cannot carry (biases, norms): refused by HyperESTrainer's
    constructor, naming the field and the deltas, not after a whole search and the merged model's save."""
    from trl_es import HyperESConfig, HyperESTrainer

    base = build_vllm_qwen2(tokenizer)
    path = _save(_peft_adapter(base, **fields), tmp_path / "a")
    args = HyperESConfig(output_dir=str(tmp_path / "out"), export_lora_rank=2, report_to=[], population_size=4,
                         max_steps=1)
    with pytest.raises(ValueError, match=r"export_lora_rank=2 cannot export \['model\.layers\.0\..*as LoRA"):
        HyperESTrainer(base, [path], args=args, fitness_fn=lambda model: 0.0)
    HyperESTrainer(base, [path], args=HyperESConfig(output_dir=str(tmp_path / "ok"), report_to=[], population_size=4,
                                                    max_steps=1), fitness_fn=lambda model: 0.0)
