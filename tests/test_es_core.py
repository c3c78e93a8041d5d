"""The ES algorithm pieces on plain nn.Modules: noise, shaping, perturb/restore, update, seed log."""

import json
import logging
import math

import pytest
import torch
from torch import nn

from trl_es.es import (
    NOISE_BLOCK_SIZE,
    GaussianNoise,
    Member,
    NoiseTable,
    SeedLog,
    SequentialPopulation,
    TrainedParameters,
    centered_ranks,
    full_noise,
    member_indices,
    replay,
    sample_population,
    select_parameters,
    shape_fitness,
)

SMALL_TABLE = NoiseTable(NOISE_BLOCK_SIZE)


def same_shape_model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)).to(dtype)


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------------------------------------- noise
@pytest.mark.parametrize("source", [SMALL_TABLE, GaussianNoise()], ids=["table", "gaussian"])
def test_every_tensor_gets_its_own_noise(source):
    model = same_shape_model()
    names = [n for n, _ in model.named_parameters()]
    noises = {n: full_noise(source, seed=7, name=n, shape=p.shape) for n, p in model.named_parameters()}
    for n in names:
        assert noises[n].dtype == torch.float32
    weights = [noises[n] for n in names if n.endswith("weight")]
    for i in range(len(weights)):
        for j in range(i + 1, len(weights)):
            assert not torch.equal(weights[i], weights[j])
            corr = torch.corrcoef(torch.stack([weights[i].flatten(), weights[j].flatten()]))[0, 1]
            assert abs(corr) < 0.3
    # Same (seed, name) -> same noise; another seed -> other noise.
    assert torch.equal(full_noise(source, 7, names[0], (16, 16)), noises[names[0]])
    assert not torch.equal(full_noise(source, 8, names[0], (16, 16)), noises[names[0]])


@pytest.mark.parametrize("source", [SMALL_TABLE, GaussianNoise()], ids=["table", "gaussian"])
def test_noise_is_partition_invariant(source):
    numel = 2 * NOISE_BLOCK_SIZE + 12345
    whole = full_noise(source, 3, "w", (numel,))
    # Any split into partitions (as DeepSpeed ZeRO-3 makes) yields the same values element by element.
    for world in (2, 3, 7):
        size = math.ceil(numel / world)
        for rank in range(world):
            start, end = rank * size, min(numel, (rank + 1) * size)
            local = torch.empty(end - start)
            for lo, hi, eps in source.pieces(3, "w", numel, start, end):
                local[lo:hi] = eps
            assert torch.equal(local, whole[start:end])


def test_noise_statistics():
    eps = full_noise(SMALL_TABLE, 11, "layer.weight", (4096, 64))
    assert abs(eps.mean().item()) < 0.01
    assert abs(eps.std().item() - 1.0) < 0.01


def test_noise_table_rejects_small_size():
    with pytest.raises(ValueError, match="noise_table_size"):
        NoiseTable(1000)


# ---------------------------------------------------------------------------------------------- shaping
def test_zscore_values():
    z = shape_fitness(torch.tensor([1.0, 2.0, 3.0, 4.0]), "zscore")
    expected = (torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64) - 2.5) / math.sqrt(1.25)
    assert torch.allclose(z, expected)


def test_equal_fitness_gives_zero_coefficients():
    for method in ("zscore", "centered_rank"):
        assert torch.equal(shape_fitness(torch.full((6,), 0.5), method), torch.zeros(6, dtype=torch.float64))


def test_centered_ranks_with_ties():
    ranks = centered_ranks(torch.tensor([3.0, 1.0, 3.0, 2.0]))
    # ranks 0..3 -> [2.5, 0, 2.5, 1] / 3 - 0.5
    assert torch.allclose(ranks, torch.tensor([2.5, 0.0, 2.5, 1.0], dtype=torch.float64) / 3 - 0.5)


def test_nan_fitness_ranked_worst(caplog):
    with caplog.at_level(logging.WARNING):
        z = shape_fitness(torch.tensor([1.0, float("nan"), 3.0]), "centered_rank")
    assert z.tolist() == [0.0, -0.5, 0.5]
    assert "NaN fitness" in caplog.text
    z = shape_fitness(torch.tensor([1.0, float("nan"), 3.0]), "zscore")
    assert z.argmin().item() == 1 and torch.isfinite(z).all()
    assert torch.equal(shape_fitness(torch.full((3,), float("nan"))), torch.zeros(3, dtype=torch.float64))


def test_unknown_shaping_raises():
    with pytest.raises(ValueError, match="fitness_shaping must be one of"):
        shape_fitness(torch.ones(3), "softmax")


# ---------------------------------------------------------------------------------------------- population
def test_antithetic_pairs_and_validation():
    members = sample_population(0, 5, 6, antithetic=True)
    assert [m.sign for m in members] == [1, -1, 1, -1, 1, -1]
    assert members[0].seed == members[1].seed and members[0].seed != members[2].seed
    assert len({m.seed for m in sample_population(0, 5, 6)}) == 6
    assert sample_population(0, 5, 6) == sample_population(0, 5, 6)
    assert sample_population(0, 5, 6) != sample_population(0, 6, 6)
    with pytest.raises(ValueError, match="even population_size"):
        sample_population(0, 0, 5, antithetic=True)
    with pytest.raises(ValueError, match="population_size must be >= 2"):
        sample_population(0, 0, 1)
    assert member_indices(5, 0, 2) == [0, 2, 4] and member_indices(5, 1, 2) == [1, 3]


# ---------------------------------------------------------------------------------------------- perturb / restore
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_restore_is_bitwise_exact(dtype):
    model = same_shape_model(dtype)
    before = state(model)
    params = TrainedParameters(select_parameters(model))
    for i in range(20):
        params.perturb_(SMALL_TABLE, Member(i, 1 if i % 2 else -1), sigma=1e-2)
        assert not torch.equal(model[0].weight, before["0.weight"])
        params.restore_()
    assert_bitwise_equal(state(model), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_perturbation_value(dtype):
    model = same_shape_model(dtype)
    w0 = model[1].weight.detach().float().clone()
    params = TrainedParameters(select_parameters(model))
    params.perturb_(SMALL_TABLE, Member(5, -1), sigma=0.1)
    eps = full_noise(SMALL_TABLE, 5, "1.weight", w0.shape)
    assert torch.equal(model[1].weight.detach(), torch.add(w0, eps, alpha=-0.1).to(dtype))
    assert torch.allclose(model[1].weight.detach().float(), w0 - 0.1 * eps, atol=1e-2 if dtype != torch.float32 else 1e-6)


class Boom(Exception):
    pass


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_exception_in_rollout_restores_weights(error):
    model = same_shape_model(torch.bfloat16)
    before = state(model)
    params = TrainedParameters(select_parameters(model))
    members = sample_population(0, 0, 4)

    def rollout(i):
        if i == 2:
            raise error("member 2 failed")
        return 1.0

    with pytest.raises(error):
        SequentialPopulation().evaluate(params, SMALL_TABLE, members, range(4), 0.1, rollout)
    assert_bitwise_equal(state(model), before)


# ---------------------------------------------------------------------------------------------- update
def test_update_matches_formula():
    model = same_shape_model()
    w0 = model[0].weight.detach().clone()
    params = TrainedParameters(select_parameters(model))
    members = [Member(1, 1), Member(1, -1), Member(2, 1)]
    z = [0.5, -1.0, 2.0]
    params.es_update_(SMALL_TABLE, members, z, learning_rate=0.01)
    e1 = full_noise(SMALL_TABLE, 1, "0.weight", w0.shape)
    e2 = full_noise(SMALL_TABLE, 2, "0.weight", w0.shape)
    expected = w0 + 0.01 / 3 * (0.5 * e1 + 1.0 * e1 + 2.0 * e2)
    assert torch.allclose(model[0].weight, expected, atol=1e-7)


def test_zero_coefficients_leave_weights_bitwise():
    model = same_shape_model(torch.bfloat16)
    before = state(model)
    params = TrainedParameters(select_parameters(model))
    params.es_update_(SMALL_TABLE, sample_population(0, 0, 4), [0.0] * 4, learning_rate=1.0)
    assert_bitwise_equal(state(model), before)


def test_fp32_master_keeps_small_updates_of_bf16_model():
    model = same_shape_model(torch.bfloat16)
    w0 = model[0].weight.detach().float().clone()
    params = TrainedParameters(select_parameters(model))  # fp32 master
    naive = TrainedParameters(select_parameters(same_shape_model(torch.bfloat16)), master_dtype=None)
    members = [Member(3, 1), Member(4, 1)]
    for _ in range(100):  # each step ~1e-6: far below bf16's resolution at |w| ~ 0.1 (~4e-4)
        params.es_update_(SMALL_TABLE, members, [1.0, -1.0], learning_rate=2e-6)
        naive.es_update_(SMALL_TABLE, members, [1.0, -1.0], learning_rate=2e-6)
    master = params.master_state_dict()["0.weight"]
    assert master.dtype == torch.float32
    moved = (master - w0).abs().max().item()
    assert moved > 5e-5  # 100 steps of ~1e-6 accumulated in the fp32 master
    assert torch.equal(model[0].weight, master.to(torch.bfloat16))  # the model is the rounded master
    assert (model[0].weight.float() != w0).any()  # and the accumulated drift does show in bf16
    # Without the master, every 16-bit rounding loses the step: most weights never move.
    naive_w = naive.master_state_dict()["0.weight"].float()
    assert (naive_w != w0).float().mean() < (model[0].weight.float() != w0).float().mean()


def test_torch_gradient_with_sgd_equals_es_update():
    model_a, model_b = same_shape_model(), same_shape_model()
    a = TrainedParameters(select_parameters(model_a))
    b = TrainedParameters(select_parameters(model_b))
    members, z = sample_population(0, 0, 4), [1.0, -0.5, 0.25, -0.75]
    a.es_update_(SMALL_TABLE, members, z, learning_rate=0.1)
    b.es_gradient_(SMALL_TABLE, members, z)
    torch.optim.SGD(b.master_parameters(), lr=0.1).step()
    b.render_()
    for (na, pa), (_, pb) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert torch.allclose(pa, pb, atol=1e-7), na


def test_select_parameters_regex_and_errors():
    model = same_shape_model()
    names = [n for n, _ in select_parameters(model, include=r"weight", exclude=r"^2\.")]
    assert names == ["0.weight", "1.weight"]
    with pytest.raises(ValueError, match="No parameter selected"):
        select_parameters(model, include="nothing-matches")
    with pytest.raises(ValueError, match="Invalid regular expression"):
        select_parameters(model, include="(")


# ---------------------------------------------------------------------------------------------- AWD
def test_awd_l2_shrink_factor_and_l1_soft_threshold():
    model = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -1.0], [0.5, 0.0]]))
    params = TrainedParameters(select_parameters(model))
    anchor = {"weight": torch.zeros(2, 2)}
    params.anchored_weight_decay_(anchor, shrink=0.25, penalty="l2")
    assert torch.equal(model.weight.detach(), torch.tensor([[0.75, -0.75], [0.375, 0.0]]))
    params.anchored_weight_decay_(anchor, shrink=0.5, penalty="l1")
    assert torch.equal(model.weight.detach(), torch.tensor([[0.25, -0.25], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="learning_rate \\* awd_lambda < 1"):
        params.anchored_weight_decay_(anchor, shrink=1.0, penalty="l2")
    with pytest.raises(ValueError, match="awd_penalty must be one of"):
        params.anchored_weight_decay_(anchor, shrink=0.1, penalty="l3")


# ---------------------------------------------------------------------------------------------- seed log
def test_seed_log_roundtrip_and_replay_bitwise(tmp_path):
    model = same_shape_model(torch.bfloat16)
    base = state(model)
    params = TrainedParameters(select_parameters(model))
    log = SeedLog(header={"noise": SMALL_TABLE.describe(), "optimizer": "es", "master_dtype": "float32",
                          "parameters": [[e.name, e.numel] for e in params.entries], "awd_penalty": "l2"})
    anchor = {n: t.clone() for n, t in params.master_state_dict().items()}
    for step in range(3):
        members = sample_population(42, step, 4, antithetic=True)
        z = shape_fitness(torch.randn(4)).tolist()
        params.es_update_(SMALL_TABLE, members, z, learning_rate=1e-2)
        params.anchored_weight_decay_(anchor, 0.1, "l2")
        log.append(step + 1, members, z, 1e-2, awd_shrink=0.1)
    path = tmp_path / "log.jsonl"
    log.save(str(path))
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["format"] == "trl_es.seedlog"
    assert len(path.read_bytes()) < 4096  # a whole run is a few hundred bytes per iteration

    fresh = same_shape_model(torch.bfloat16)
    assert_bitwise_equal(state(fresh), base)
    replay(fresh, str(path))
    assert_bitwise_equal(state(fresh), state(model))
    partial = replay(same_shape_model(torch.bfloat16), str(path), max_step=1)
    assert not torch.equal(partial[0].weight, model[0].weight)


def test_replay_rejects_foreign_file(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"hello": 1}\n')
    with pytest.raises(ValueError, match="not a trl_es seed log"):
        replay(same_shape_model(), str(path))
