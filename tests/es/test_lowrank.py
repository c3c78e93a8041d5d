"""Batched low-rank population (EGGROLL, arXiv 2511.16652): batched forward == materialized W + E_i, update, replay."""

import json
import os

import pytest
import torch
from datasets import Dataset
from tiny import build_llama, build_qwen2

from trl_es import ESConfig, ESTrainer, replay
from trl_es.es import SEED_LOG_NAME
from trl_es.es.noise import NoiseTable
from trl_es.es.perturbation import (LowRankPerturbation, Member, TrainedParameters, es_gradient_, es_update_,
                                    linear_weight_names, lowrank_perturbation, select_parameters)
from oracles import LINEARS, materialized, members3
from population_loop import score_population

from trl_es.es.strategy import BatchedLowRankPopulation, make_population_backend
from trl_es.rollout import build_generation_config, generate_completions

SMALL_TABLE = 1 << 20
PROMPTS = ["Write: 1", "Hello there, friend"]  # different lengths: left padding is exercised


@pytest.fixture(scope="module")
def noise():
    return NoiseTable(SMALL_TABLE)


class StackedRollout:
    """ESTrainer's rollout of a group: ONE greedy generate over the prompts repeated once per member of the group;
    member ``group[k]`` owns rows ``[k * W, (k + 1) * W)``. Called with the group's members applied."""

    def __init__(self, model, tokenizer, prompts=PROMPTS, max_new_tokens=8, use_cache=True, fail=False):
        self.model, self.tokenizer, self.prompts = model, tokenizer, list(prompts)
        self.config = build_generation_config(tokenizer, max_new_tokens)
        self.use_cache, self.fail = use_cache, fail
        self.ids, self.calls = {}, []

    def __call__(self, indices):
        self.calls.append(list(indices))
        _, ids = generate_completions(self.model, self.tokenizer, self.prompts * len(indices), self.config,
                                      use_cache=self.use_cache)
        if self.fail:
            raise RuntimeError("reward function failed")
        width = len(self.prompts)
        for k, index in enumerate(indices):
            self.ids[index] = ids[k * width : (k + 1) * width]
        return {index: float(sum(map(sum, self.ids[index]))) for index in indices}


def evaluate(backend, params, noise, members, indices, sigma, rollout):
    """The member loop over ``backend``'s groups with ``rollout`` (a :class:`StackedRollout`)."""
    return score_population(backend, params, noise, members, indices, sigma, rollout, rollout.model)


def greedy_ids(model, tokenizer, prompts=PROMPTS, max_new_tokens=8, use_cache=True):
    _, ids = generate_completions(model, tokenizer, prompts, build_generation_config(tokenizer, max_new_tokens),
                                  use_cache=use_cache)
    return ids


def encode(tokenizer, prompts):
    return tokenizer(text=prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)


# ---------------------------------------------------------------------------------------------- construction
def test_describe_round_trips_and_rank_is_validated(tmp_path):
    backend = BatchedLowRankPopulation(noise_rank=3)
    assert backend.describe() == {"name": "batched_lowrank", "noise_rank": 3}
    facts = backend.describe()
    rebuilt = make_population_backend(facts.pop("name"), **facts)
    assert isinstance(rebuilt, BatchedLowRankPopulation) and rebuilt.noise_rank == 3
    with pytest.raises(ValueError, match="noise_rank"):
        BatchedLowRankPopulation(noise_rank=0)
    with pytest.raises(ValueError, match="member_chunk_size"):
        BatchedLowRankPopulation(member_chunk_size=0)
    assert backend.perturbation.describe() == {"type": "lowrank", "rank": 3}
    with pytest.raises(ValueError, match="noise_rank"):
        ESConfig(output_dir=str(tmp_path), population_backend="batched_lowrank", noise_rank=0)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="member_chunk_size"):
            ESConfig(output_dir=str(tmp_path), population_backend="batched_lowrank", member_chunk_size=bad)


def test_perturbation_is_rank_r_with_unit_variance_entries(noise):
    e = lowrank_perturbation(noise, Member(5, -1), "w", (256, 128), rank=4)
    assert e.shape == (256, 128)
    assert torch.linalg.matrix_rank(e).item() == 4  # fp32 tolerance
    assert 0.8 < e.var().item() < 1.2  # A B^T / sqrt(r) has unit-variance entries
    assert torch.equal(lowrank_perturbation(noise, Member(5, 1), "w", (256, 128), rank=4), -e)
    assert not torch.equal(lowrank_perturbation(noise, Member(5, 1), "v", (256, 128), rank=4).abs(), e.abs())


# ---------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("rank", [1, 2])
def test_stacked_forward_matches_materialized_models_row_for_row(tokenizer, noise, rank):
    model = build_llama(tokenizer).eval()
    params = TrainedParameters(select_parameters(model, LINEARS))
    members, sigma = members3(), 0.05
    inputs = encode(tokenizer, PROMPTS)
    stacked = {k: v.repeat(3, 1) for k, v in inputs.items()}  # 3 members x 2 rows
    adapters = BatchedLowRankPopulation(noise_rank=rank).adapters(model, params)
    with torch.no_grad():
        base = model(**inputs).logits
        with adapters.members(noise, members, sigma):
            logits = model(**stacked).logits
        after = model(**inputs).logits
    assert torch.equal(after, base)  # adapters inactive, weights untouched
    with adapters.members(noise, members, sigma):  # with autograd: the out-of-place branch
        with_grad = model(**stacked).logits
    assert with_grad.requires_grad
    torch.testing.assert_close(with_grad.detach(), logits, atol=1e-5, rtol=0)
    blocks = []
    for k, member in enumerate(members):
        with torch.no_grad():
            expected = materialized(model, noise, member, sigma, rank)(**inputs).logits
        torch.testing.assert_close(logits[2 * k : 2 * k + 2], expected, atol=2e-5, rtol=1e-4)
        blocks.append(logits[2 * k : 2 * k + 2])
    # the members really differ from each other and from the base model
    assert (blocks[0] - base).abs().max() > 1e-2
    assert (blocks[0] - blocks[2]).abs().max() > 1e-2


@pytest.mark.parametrize("use_cache", [True, False])
def test_evaluate_generate_matches_materialized_members(tokenizer, noise, use_cache):
    model = build_llama(tokenizer).eval()
    params = TrainedParameters(select_parameters(model, LINEARS))
    members, sigma = members3(), 0.05
    rollout = StackedRollout(model, tokenizer, use_cache=use_cache)
    backend = BatchedLowRankPopulation(noise_rank=2)
    results = evaluate(backend, params, noise, members, [0, 1, 2], sigma, rollout)
    assert rollout.calls == [[0, 1, 2]]  # one generate for all members
    assert sorted(results) == [0, 1, 2]
    assert all(results[i] == float(sum(map(sum, rollout.ids[i]))) for i in range(3))
    for i, member in enumerate(members):
        expected = greedy_ids(materialized(model, noise, member, sigma, 2), tokenizer, use_cache=use_cache)
        assert rollout.ids[i] == expected, i
    base = greedy_ids(model, tokenizer)
    assert len({str(rollout.ids[i]) for i in range(3)} | {str(base)}) == 4  # every member generates differently
    assert set(backend.timings) == {"perturb", "restore"}


def test_member_chunks_give_the_same_results(tokenizer, noise):
    model = build_llama(tokenizer).eval()
    params = TrainedParameters(select_parameters(model, LINEARS))
    members = members3() + [Member(29, -1)]
    whole = StackedRollout(model, tokenizer, max_new_tokens=5)
    evaluate(BatchedLowRankPopulation(noise_rank=1), params, noise, members, [0, 1, 2, 3], 0.05, whole)
    chunked = StackedRollout(model, tokenizer, max_new_tokens=5)
    results = evaluate(BatchedLowRankPopulation(noise_rank=1, member_chunk_size=3), params, noise, members,
                       [3, 1, 2, 0], 0.05, chunked)
    assert chunked.calls == [[3, 1, 2], [0]]
    assert sorted(results) == [0, 1, 2, 3]
    assert chunked.ids == whole.ids


def hook_ids(model):
    return {(name, key) for name, m in model.named_modules() for key in m._forward_hooks}


def test_adapters_are_registered_once_and_inactive_after_exception(tokenizer, noise):
    model = build_llama(tokenizer).eval()
    params = TrainedParameters(select_parameters(model, LINEARS))
    inputs = encode(tokenizer, PROMPTS)
    with torch.no_grad():
        before = model(**inputs).logits
    backend = BatchedLowRankPopulation(noise_rank=2)
    evaluate(backend, params, noise, members3(), [0, 1, 2], 0.05, StackedRollout(model, tokenizer))
    hooks = hook_ids(model)
    assert len(hooks) == len(params.entries)  # one persistent hook per targeted Linear
    evaluate(backend, params, noise, members3(), [0, 1], 0.05, StackedRollout(model, tokenizer))
    assert hook_ids(model) == hooks  # nothing registered per call
    rollout = StackedRollout(model, tokenizer, fail=True)
    with pytest.raises(RuntimeError, match="reward function failed"):
        evaluate(backend, params, noise, members3(), [0, 1, 2], 0.05, rollout)
    assert len(rollout.calls) == 1  # the perturbed generate ran before the failure
    assert not backend.adapters(model, params).active
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, before)
    backend.close()
    assert hook_ids(model) == set()


def test_batch_not_a_multiple_of_members_raises_and_cleans_up(tokenizer, noise):
    model = build_llama(tokenizer).eval()
    params = TrainedParameters(select_parameters(model, LINEARS))
    inputs = encode(tokenizer, PROMPTS)  # 2 rows for 3 members
    adapters = BatchedLowRankPopulation().adapters(model, params)
    with pytest.raises(ValueError, match="multiple"), torch.no_grad(), adapters.members(noise, members3(), 0.05):
        model(**inputs)
    assert not adapters.active


def test_non_linear_parameters_are_rejected(tokenizer, noise):
    backend = BatchedLowRankPopulation()
    llama = build_llama(tokenizer)
    rollout = StackedRollout(llama, tokenizer)
    norms = TrainedParameters(select_parameters(llama, r"(q_proj\.weight|norm\.weight)$"))
    with pytest.raises(ValueError, match="include_parameters") as error:
        evaluate(backend, norms, noise, members3(), [0, 1, 2], 0.05, rollout)
    assert "input_layernorm" in str(error.value) and "q_proj" not in str(error.value)
    assert rollout.calls == []
    qwen = build_qwen2(tokenizer)  # lm_head tied to the embeddings: not a plain Linear weight
    tied = TrainedParameters(select_parameters(qwen, r"embed_tokens"))
    with pytest.raises(ValueError, match="embed_tokens"):
        evaluate(backend, tied, noise, members3(), [0, 1, 2], 0.05, StackedRollout(qwen, tokenizer))
    masters = [e.master.clone() for e in norms.entries]
    with pytest.raises(ValueError, match="low-rank noise"):
        es_update_(norms, backend.perturbation, noise, members3(), [1.0, 0.0, -1.0], 0.1)
    assert all(torch.equal(m, e.master) for m, e in zip(masters, norms.entries))  # nothing moved, not even q_proj
    with pytest.raises(ValueError, match="include_parameters"):
        backend.check(norms, llama)

    class NoModel:
        model = None

        def __call__(self, group):
            return {i: 0.0 for i in group}

    with pytest.raises(ValueError, match="model"):
        evaluate(backend, TrainedParameters(select_parameters(llama, LINEARS)), noise, members3(), [0], 0.05, NoModel())


# ---------------------------------------------------------------------------------------------- update
def expected_direction(noise, members, coefficients, name, shape, rank):
    """``sum_i z_i sign_i A_i B_i^T / sqrt(r)`` in float64."""
    total = torch.zeros(shape, dtype=torch.float64)
    for m, z in zip(members, coefficients):
        total += z * lowrank_perturbation(noise, m, name, shape, rank).double()
    return total


@pytest.mark.parametrize("rank", [1, 3])
def test_update_and_gradient_equal_the_materialized_sum(tokenizer, noise, rank):
    model = build_llama(tokenizer)
    params = TrainedParameters(select_parameters(model, LINEARS))
    before = {e.name: e.master.clone() for e in params.entries}
    members, coefficients, lr = members3(), [0.5, -1.0, 2.0], 0.1
    perturbation = LowRankPerturbation(rank)
    es_gradient_(params, perturbation, noise, members, coefficients)
    grads = {e.name: e.master.grad.clone() for e in params.entries}
    es_update_(params, perturbation, noise, members, coefficients, lr)
    named = dict(model.named_parameters())
    for e in params.entries:
        direction = expected_direction(noise, members, coefficients, e.name, tuple(e.param.shape), rank)
        expected = before[e.name].double() + lr / 3 * direction
        torch.testing.assert_close(e.master.double(), expected, atol=1e-6, rtol=0)
        torch.testing.assert_close(grads[e.name].double(), -direction / 3, atol=1e-6, rtol=0)
        assert torch.equal(named[e.name].data, e.master)  # rendered into the model
        assert (e.master - before[e.name]).abs().max() > 1e-3
    # SGD with lr = alpha on the gradient reproduces the step
    fresh = TrainedParameters(select_parameters(build_llama(tokenizer), LINEARS))
    es_gradient_(fresh, perturbation, noise, members, coefficients)
    torch.optim.SGD(fresh.master_parameters(), lr=lr).step()
    for e, f in zip(params.entries, fresh.entries):
        torch.testing.assert_close(f.master, e.master, atol=1e-6, rtol=0)


def test_update_into_bf16_master(tokenizer, noise):
    model = build_llama(tokenizer, dtype=torch.bfloat16)
    params = TrainedParameters(select_parameters(model, r"q_proj\.weight$"), master_dtype=None)
    before = {e.name: e.master.float().clone() for e in params.entries}
    members, coefficients = members3(), [1.0, -1.0, 0.5]
    es_update_(params, LowRankPerturbation(2), noise, members, coefficients, 0.3)
    for e in params.entries:
        direction = expected_direction(noise, members, coefficients, e.name, tuple(e.param.shape), 2)
        expected = (before[e.name].double() + 0.1 * direction).to(torch.bfloat16)
        assert e.master.dtype == torch.bfloat16
        assert (e.master.float() - expected.float()).abs().max() <= 2 ** -7 * expected.float().abs().max()


# ---------------------------------------------------------------------------------------------- trainer
def es_args(tmp_path, **kwargs):
    defaults = {
        "output_dir": str(tmp_path / "out"), "max_steps": 2, "population_size": 4, "prompt_batch_size": 4,
        "max_completion_length": 6, "sigma": 0.02, "learning_rate": 0.02, "report_to": [], "save_strategy": "no",
        "noise_table_size": SMALL_TABLE, "disable_tqdm": True, "seed": 0, "population_backend": "batched_lowrank",
        "include_parameters": LINEARS,
    }
    defaults.update(kwargs)
    return ESConfig(**defaults)


def prompts(n=8, offset=0):
    return Dataset.from_dict({"prompt": [f"Write: {i}" for i in range(offset, offset + n)]})


def mean_code(completions, **kwargs):
    return [sum(map(ord, c)) / (128 * max(1, len(c))) for c in completions]


def share_a(completions, **kwargs):
    return [c.count("a") / max(1, len(c)) for c in completions]


def snapshot(model):
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def test_trainer_run_is_replayed_bitwise(tmp_path, tokenizer):
    model = build_llama(tokenizer)
    base = snapshot(model)
    args = es_args(tmp_path, max_steps=3, antithetic=True, noise_rank=2, fitness_shaping="centered_rank")
    trainer = ESTrainer(model, mean_code, args=args, train_dataset=prompts(8), processing_class=tokenizer)
    assert trainer.es_params.master_bytes == 0  # fp32 model, weights never written by members: no master copy
    trainer.train()
    assert trainer.seed_log.header["population_backend"] == {"name": "batched_lowrank", "noise_rank": 2}
    assert trainer.seed_log.header["perturbation"] == {"type": "lowrank", "rank": 2}
    trained = snapshot(trainer.model)
    changed = {k for k in base if not torch.equal(base[k], trained[k])}
    assert changed and all(k.endswith("proj.weight") or k == "lm_head.weight" for k in changed)
    assert "model.norm.weight" not in changed and "model.embed_tokens.weight" not in changed
    fresh = build_llama(tokenizer)
    replay(fresh, os.path.join(args.output_dir, SEED_LOG_NAME))
    replayed = snapshot(fresh)
    for k in trained:
        assert torch.equal(replayed[k], trained[k]), k


def test_trainer_member_chunk_size_reaches_the_backend(tmp_path, tokenizer):
    """ESConfig.member_chunk_size sets the members per generate call; chunking does not change the step."""
    coefficients = {}
    for chunk in (None, 3):
        args = es_args(tmp_path / str(chunk), max_steps=1, population_size=6, member_chunk_size=chunk)
        trainer = ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=prompts(8),
                            processing_class=tokenizer)
        assert trainer.population.member_chunk_size == chunk
        trainer.train()
        with open(os.path.join(args.output_dir, SEED_LOG_NAME)) as f:
            coefficients[chunk] = torch.tensor(json.loads(f.read().splitlines()[-1])["coefficients"])
    assert coefficients[None].shape == (6,) and coefficients[None].abs().sum() > 0
    torch.testing.assert_close(coefficients[3], coefficients[None], rtol=0, atol=1e-6)


def test_trainer_rejects_non_linear_selection_before_any_work(tmp_path, tokenizer):
    model = build_llama(tokenizer)
    before = snapshot(model)
    args = es_args(tmp_path, include_parameters=r"(q_proj|norm)\.weight$", max_steps=1)
    with pytest.raises(ValueError, match="include_parameters"):
        ESTrainer(model, mean_code, args=args, train_dataset=prompts(8), processing_class=tokenizer)
    assert all(torch.equal(v, before[k]) for k, v in snapshot(model).items())
    assert hook_ids(model) == set()


@pytest.mark.parametrize("builder", [build_llama, build_qwen2])
def test_trainer_default_selection_is_the_linear_weights(tmp_path, tokenizer, builder):
    """Without include_parameters the low-rank backend trains every nn.Linear weight not tied to another module."""
    model = builder(tokenizer)
    args = es_args(tmp_path, include_parameters=None, max_steps=1)
    trainer = ESTrainer(model, mean_code, args=args, train_dataset=prompts(8), processing_class=tokenizer)
    names = set(trainer.es_params.names)
    expected = {n for n, _ in model.named_parameters() if n.endswith("proj.weight")}
    if builder is build_llama:
        expected.add("lm_head.weight")  # untied: a plain Linear
    assert names == expected == set(linear_weight_names(model))
    trainer.train()
    assert hook_ids(model) == set()  # the adapters are removed when training ends


def test_trainer_raises_a_simple_reward(tmp_path, tokenizer):
    """With fixed seeds, batched low-rank ES raises the share of 'a' in greedy completions of a random tiny Llama."""
    args = es_args(tmp_path, max_steps=10, population_size=8, antithetic=True, prompt_batch_size=8,
                   max_completion_length=8, noise_rank=4, learning_rate=0.03)
    trainer = ESTrainer(build_llama(tokenizer), share_a, args=args, train_dataset=prompts(32),
                        eval_dataset=prompts(16, offset=100), processing_class=tokenizer)
    before = trainer.evaluate()["eval_reward"]
    trainer.train()
    after = trainer.evaluate()["eval_reward"]
    assert before < 0.05
    assert after > before + 0.3


def test_optimizer_follows_shared_masters_that_moved(tmp_path, tokenizer):
    """fp32 weights are their own masters with this backend; when preparing the model moves them (accelerate's
    multi-process device copies them), the torch optimizer must own the new tensors, or its steps reach nothing."""
    model = build_llama(tokenizer)
    trainer = ESTrainer(model, mean_code, args=es_args(tmp_path, es_optimizer="torch", optim="sgd", max_steps=1),
                        train_dataset=prompts(8), processing_class=tokenizer)
    trainer.create_optimizer()
    with torch.no_grad():
        for p in model.parameters():  # what model.to("cpu:0") does under torchrun: new storage, same values
            p.data = p.data.clone()
    trainer._rebind_es_params()
    masters = trainer.es_params.master_parameters()
    assert all(e.master_is_param for e in trainer.es_params.entries)
    owned = trainer.optimizer.param_groups[0]["params"]
    assert len(owned) == len(masters) and all(a is b for a, b in zip(owned, masters))


def test_sampling_chunks_draw_from_different_streams(tmp_path, tokenizer):
    """With sampling, each stacked generate call is seeded by its first member: two chunks of two members each do not
    replay the same random numbers, and the same call gives the same samples again."""
    args = es_args(tmp_path, temperature=1.0, member_chunk_size=2, include_parameters=None, population_size=4)
    trainer = ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=prompts(8),
                        processing_class=tokenizer)
    members = [Member(5, 1), Member(5, -1), Member(9, 1), Member(9, -1)]
    rows = [prompts(4)[i] for i in range(4)]
    trainer.args.sigma = 0.0  # every member is the unperturbed model: only the random streams differ

    def run():
        return trainer._score_members(members, rows, step=0)  # the trainer's member loop

    first, again = run(), run()
    texts = {i: first[i].texts for i in range(4)}
    assert texts == {i: again[i].texts for i in range(4)}
    assert texts[0] != texts[2]  # chunk [0, 1] and chunk [2, 3] used different streams
    trainer.population.close()
