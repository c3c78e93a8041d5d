"""The ES algorithm pieces on plain nn.Modules: noise, shaping, perturb/restore, update, seed log, anchor."""

import hashlib
import json
import logging
import math
import os
import warnings

import pytest
import torch
from torch import nn

from safetensors.torch import load_file, save_file

from trl_es.es import (
    NOISE_BLOCK_SIZE,
    DeviceGaussianNoise,
    GaussianNoise,
    GaussianPerturbation,
    Member,
    NoiseTable,
    SeedLog,
    SequentialPopulation,
    TrainedParameters,
    centered_ranks,
    es_gradient_,
    es_update_,
    full_noise,
    make_noise_source,
    member_indices,
    merge_ties,
    replay,
    sample_population,
    select_parameters,
    shape_fitness,
)
from population_loop import score_population

from trl_es.es.anchor import FileAnchor, MemoryAnchor, make_anchor
from trl_es.es.noise import LEGACY_GENERATOR, standard_normal
from paths import DATA

SMALL_TABLE = NoiseTable(NOISE_BLOCK_SIZE)
GAUSSIAN = GaussianPerturbation()
LEGACY = os.path.join(DATA, "legacy_seedlogs")


def perturb_(params, noise, member, sigma):
    GAUSSIAN.perturb_(params, noise, member, sigma)


def update_(params, noise, members, z, learning_rate):
    es_update_(params, GAUSSIAN, noise, members, z, learning_rate)


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
    assert "no finite fitness" in caplog.text
    z = shape_fitness(torch.tensor([1.0, float("nan"), 3.0]), "zscore")
    assert z.argmin().item() == 1 and torch.isfinite(z).all()
    assert torch.equal(shape_fitness(torch.full((3,), float("nan"))), torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("value", [1 / 3, 5 / 12, 0.7, 0.1 + 0.2])
@pytest.mark.parametrize("n", [2, 3, 7, 12, 30, 31])
def test_non_dyadic_ties_give_exactly_zero_coefficients(value, n):
    """Equal fitness that is not exactly representable: the float64 mean is an ulp off, the std ~1e-17; the old
    rule turned that into coefficients of +-1 (a full random step)."""
    tied = torch.full((n,), value, dtype=torch.float64)
    for method in ("zscore", "centered_rank"):
        assert torch.equal(shape_fitness(tied, method), torch.zeros(n, dtype=torch.float64)), method
    # the same population mean computed in different orders (differs by ulps) is a tie too
    rewards = torch.tensor([1 / 3, 0.1, 0.7, 0.25], dtype=torch.float64)
    orders = [rewards[torch.randperm(4, generator=torch.Generator().manual_seed(k))].cumsum(0)[-1] / 4
              for k in range(n)]
    assert len({float(o) for o in orders}) >= 1
    assert torch.equal(shape_fitness(torch.stack(orders), "zscore"), torch.zeros(n, dtype=torch.float64))


def test_end_to_end_ties_leave_the_weights_bitwise():
    """Population 30, a fitness of 1/3 for everyone (1 prompt of 3 right): the ES step is exactly zero."""
    model = same_shape_model()
    before = state(model)
    params = TrainedParameters(select_parameters(model))
    members = sample_population(0, 0, 30)
    fitness = torch.tensor([sum([1.0, 0.0, 0.0]) / 3] * 30, dtype=torch.float64)
    update_(params, SMALL_TABLE, members, shape_fitness(fitness, "zscore").tolist(), learning_rate=0.5)
    assert_bitwise_equal(state(model), before)


def test_ties_merge_only_up_to_rounding():
    # real differences, however small in absolute terms, are signal
    z = shape_fitness(torch.tensor([1e-10, 2e-10, 1e-10], dtype=torch.float64), "zscore")
    assert torch.allclose(z, torch.tensor([-1, 2, -1], dtype=torch.float64) / math.sqrt(2))
    # an ulp-level difference inside a population with a real spread is merged into one tie group
    f = torch.tensor([0.1 + 0.2, 0.3, 0.1, 0.3], dtype=torch.float64)
    merged = merge_ties(f)
    assert merged[0] == merged[1] == merged[3] and merged[2] == 0.1
    ranks = shape_fitness(f, "centered_rank")
    assert ranks[0] == ranks[1] == ranks[3] and ranks[2] == -0.5


def test_none_shaping_with_ties_warns():
    with pytest.warns(UserWarning, match="random step"):
        coefficients = shape_fitness(torch.full((4,), 0.5, dtype=torch.float64), "none")
    assert coefficients.tolist() == [0.5] * 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shape_fitness(torch.tensor([0.5, 1.0]), "none")  # no tie: no warning


@pytest.mark.parametrize("method", ["zscore", "centered_rank", "none"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_fitness_is_ranked_worst_and_finite(method, bad, caplog):
    with caplog.at_level(logging.WARNING):
        z = shape_fitness(torch.tensor([0.2, bad, 0.6, 0.4], dtype=torch.float64), method)
    assert torch.isfinite(z).all()
    assert z.argmin().item() == 1
    assert "no finite fitness" in caplog.text


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
def check_perturb_restore_cycles(model, cycles: int):
    """``cycles`` perturb/restore rounds with alternating signs: each perturbs, and the end is bitwise the start."""
    before = state(model)
    params = TrainedParameters(select_parameters(model))
    for i in range(cycles):
        perturb_(params, SMALL_TABLE, Member(i, 1 if i % 2 else -1), sigma=1e-2)
        assert not torch.equal(model[0].weight, before["0.weight"])
        params.write_master_to_model_()
    assert_bitwise_equal(state(model), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_restore_is_bitwise_exact(dtype):
    check_perturb_restore_cycles(same_shape_model(dtype), 20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_restore_is_bitwise_exact_on_cuda():
    model = same_shape_model(torch.bfloat16).cuda()
    check_perturb_restore_cycles(model, 6)
    assert model[0].weight.is_cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_perturbation_value(dtype):
    model = same_shape_model(dtype)
    w0 = model[1].weight.detach().float().clone()
    params = TrainedParameters(select_parameters(model))
    perturb_(params, SMALL_TABLE, Member(5, -1), sigma=0.1)
    eps = full_noise(SMALL_TABLE, 5, "1.weight", w0.shape)
    assert torch.equal(model[1].weight.detach(), (w0 + eps * -0.1).to(dtype))  # a multiply, then an add (portable)
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

    seen = []

    def score(group):
        seen.append(list(group))
        return {i: rollout(i) for i in group}

    with pytest.raises(error):
        score_population(SequentialPopulation(), params, SMALL_TABLE, members, range(4), 0.1, score)
    assert seen == [[0], [1], [2]]  # one member at a time, the failing one last
    assert_bitwise_equal(state(model), before)


# ---------------------------------------------------------------------------------------------- update
def test_update_matches_formula():
    model = same_shape_model()
    w0 = model[0].weight.detach().clone()
    params = TrainedParameters(select_parameters(model))
    members = [Member(1, 1), Member(1, -1), Member(2, 1)]
    z = [0.5, -1.0, 2.0]
    update_(params, SMALL_TABLE, members, z, learning_rate=0.01)
    e1 = full_noise(SMALL_TABLE, 1, "0.weight", w0.shape)
    e2 = full_noise(SMALL_TABLE, 2, "0.weight", w0.shape)
    expected = w0 + 0.01 / 3 * (0.5 * e1 + 1.0 * e1 + 2.0 * e2)
    assert torch.allclose(model[0].weight, expected, atol=1e-7)


def test_zero_coefficients_leave_weights_bitwise():
    model = same_shape_model(torch.bfloat16)
    before = state(model)
    params = TrainedParameters(select_parameters(model))
    update_(params, SMALL_TABLE, sample_population(0, 0, 4), [0.0] * 4, learning_rate=1.0)
    assert_bitwise_equal(state(model), before)


def test_fp32_master_keeps_small_updates_of_bf16_model():
    model = same_shape_model(torch.bfloat16)
    w0 = model[0].weight.detach().float().clone()
    params = TrainedParameters(select_parameters(model))  # fp32 master
    naive = TrainedParameters(select_parameters(same_shape_model(torch.bfloat16)), master_dtype=None)
    members = [Member(3, 1), Member(4, 1)]
    for _ in range(100):  # each step ~1e-6: far below bf16's resolution at |w| ~ 0.1 (~4e-4)
        update_(params, SMALL_TABLE, members, [1.0, -1.0], learning_rate=2e-6)
        update_(naive, SMALL_TABLE, members, [1.0, -1.0], learning_rate=2e-6)
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
    update_(a, SMALL_TABLE, members, z, learning_rate=0.1)
    es_gradient_(b, GAUSSIAN, SMALL_TABLE, members, z)
    torch.optim.SGD(b.master_parameters(), lr=0.1).step()
    b.write_master_to_model_()
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
        update_(params, SMALL_TABLE, members, z, learning_rate=1e-2)
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


# ---------------------------------------------------------------------------------------------- old seed logs
# sha256 of ``standard_normal(64, 1, LEGACY_GENERATOR)`` where the legacy logs were trained: torch.randn's AVX2 kernel
LEGACY_RANDN_SHA256 = "64afc030894f6f0465ac7f3391f0c2caade076e3dfd6860e237f11806fbf8557"


def legacy_randn_as_recorded() -> bool:
    draw = standard_normal(64, 1, LEGACY_GENERATOR)
    return hashlib.sha256(draw.numpy().tobytes()).hexdigest() == LEGACY_RANDN_SHA256


@pytest.mark.parametrize("run", ["sequential_bf16", "lowrank_fp32"])
def test_seed_logs_written_before_the_perturbation_refactor_replay_bitwise(run, tokenizer):
    """Logs written by trl_es 0.1.0 before ``Perturbation`` existed (header ``population_backend`` only; full-rank
    bf16 with AWD, and rank-2 low-rank fp32): replay still reproduces the trained weights bitwise, on a CPU whose
    ``torch.randn`` kernel is the one they were trained with (legacy noise, documented as CPU-dependent: with
    ``ATEN_CPU_CAPABILITY=default`` or on AVX-512, torch.randn draws other values, so there is nothing to compare)."""
    from tiny import build_llama

    if not legacy_randn_as_recorded():
        pytest.skip("this CPU's torch.randn kernel is not the AVX2 one the legacy seed logs were trained with")

    folder = os.path.join(LEGACY, run)
    header = json.loads(open(os.path.join(folder, "es_seed_log.jsonl")).readline())
    assert "perturbation" not in header
    base, trained = load_file(os.path.join(folder, "base.safetensors")), load_file(os.path.join(folder, "trained.safetensors"))
    model = build_llama(tokenizer, dtype=next(iter(base.values())).dtype)
    model.load_state_dict(base)
    replay(model, folder)
    replayed = model.state_dict()
    assert any(not torch.equal(base[k], trained[k]) for k in trained)
    for k in trained:
        assert torch.equal(replayed[k], trained[k]), k


# ---------------------------------------------------------------------------------------------- noise sources
def test_make_noise_source_auto_and_errors():
    assert isinstance(make_noise_source(NOISE_BLOCK_SIZE, "auto", "cpu"), NoiseTable)
    assert isinstance(make_noise_source(NOISE_BLOCK_SIZE, "auto", "cpu", lowrank=True), GaussianNoise)
    assert isinstance(make_noise_source(0, "auto", "cpu"), GaussianNoise)
    assert isinstance(make_noise_source(NOISE_BLOCK_SIZE, "auto", "cuda"), DeviceGaussianNoise)
    assert isinstance(make_noise_source(NOISE_BLOCK_SIZE, "device_gaussian"), DeviceGaussianNoise)
    with pytest.raises(ValueError, match="noise_source must be one of"):
        make_noise_source(NOISE_BLOCK_SIZE, "sobol")
    with pytest.raises(ValueError, match="noise_table_size"):
        make_noise_source(1000, "table")


def test_device_gaussian_on_cpu_equals_gaussian_and_is_partition_invariant():
    numel = NOISE_BLOCK_SIZE + 999
    whole = full_noise(DeviceGaussianNoise(), 5, "w", (numel,))
    assert torch.equal(whole, full_noise(GaussianNoise(), 5, "w", (numel,)))
    local = torch.empty(numel - 500)
    for lo, hi, eps in DeviceGaussianNoise().pieces(5, "w", numel, 500, numel):
        local[lo:hi] = eps
    assert torch.equal(local, whole[500:])


# ---------------------------------------------------------------------------------------------- masters
def test_shared_master_needs_no_copy_and_refuses_in_place_perturbation():
    model = same_shape_model()
    params = TrainedParameters(select_parameters(model), share_params=True)
    assert params.master_bytes == 0 and all(e.master_is_param for e in params.entries)
    w0 = model[0].weight.detach().clone()
    update_(params, SMALL_TABLE, [Member(1, 1)], [1.0], learning_rate=0.1)
    eps = full_noise(SMALL_TABLE, 1, "0.weight", w0.shape)
    assert torch.equal(model[0].weight.detach(), w0 + eps * 0.1)  # straight into the weights
    with pytest.raises(ValueError, match="master copy distinct"):
        perturb_(params, SMALL_TABLE, Member(2, 1), 0.1)
    # a bf16 model keeps an fp32 master even when sharing is allowed
    bf16 = TrainedParameters(select_parameters(same_shape_model(torch.bfloat16)), share_params=True)
    assert not any(e.master_is_param for e in bf16.entries) and bf16.master_bytes == 3 * (256 + 16) * 4


# ---------------------------------------------------------------------------------------------- anchor
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_anchor_from_the_checkpoint_file_equals_the_memory_copy(tmp_path, dtype):
    model = same_shape_model(dtype)
    path = str(tmp_path / "model.safetensors")
    stored = {k: v.contiguous() for k, v in model.state_dict().items()}
    stored["1.weight"] = stored["1.weight"] + 1  # the file disagrees on one tensor: that one stays in memory
    save_file(stored, path)
    params = TrainedParameters(select_parameters(model))
    memory = make_anchor(params, "memory")
    from_file = make_anchor(params, "auto", [path])
    assert isinstance(memory, MemoryAnchor) and isinstance(from_file, FileAnchor)
    assert set(from_file.sources) == {"0.weight", "0.bias", "1.bias", "2.weight", "2.bias"}
    assert from_file.resident_bytes == 256 * torch.finfo(dtype).bits // 8  # only 1.weight
    for name in memory:
        assert from_file[name].dtype == dtype and torch.equal(from_file[name], memory[name]), name
    # AWD from either anchor gives the same weights
    update_(params, SMALL_TABLE, [Member(3, 1)], [1.0], learning_rate=0.05)
    twin = TrainedParameters(select_parameters(same_shape_model(dtype)))
    update_(twin, SMALL_TABLE, [Member(3, 1)], [1.0], learning_rate=0.05)
    params.anchored_weight_decay_(from_file, 0.3)
    twin.anchored_weight_decay_(memory, 0.3)
    for a, b in zip(params.entries, twin.entries):
        assert torch.equal(a.master, b.master)


def test_file_anchor_reads_partitions(tmp_path):
    """Under ZeRO-3 an entry holds elements [start, start + n) of the flattened tensor: the anchor reads just those."""
    weight = torch.randn(7, 5)
    path = str(tmp_path / "model.safetensors")
    save_file({"w": weight}, path)
    local = weight.reshape(-1)[13:29].clone()
    params = TrainedParameters([("w", local, 35, 13)])
    anchor = make_anchor(params, "file", [path])
    assert isinstance(anchor, FileAnchor) and torch.equal(anchor["w"], local)
    with pytest.raises(ValueError, match="anchor_storage must be one of"):
        make_anchor(params, "disk")


def test_invalid_members_stay_below_ulp_tied_valid_ones_and_outliers_merge_nothing():
    # valid members equal up to one ulp, one NaN: the NaN member is still ranked strictly worst
    tied = torch.tensor([1 / 3, 1 / 3, 1 / 3 + 5.551115123125783e-17, float("nan")], dtype=torch.float64)
    for method in ("zscore", "centered_rank"):
        z = shape_fitness(tied, method)
        assert z[3] < 0 and z[0] == z[1] == z[2] > 0, method
    # a huge value elsewhere in the population does not merge real small differences
    ranks = shape_fitness(torch.tensor([0.1, 0.2, 0.3, 0.4, 1e17], dtype=torch.float64), "centered_rank")
    assert ranks.tolist() == [-0.5, -0.25, 0.0, 0.25, 0.5]
    # the gap below the worst member survives any magnitude
    big = shape_fitness(torch.tensor([3e15, 3e15, float("inf")], dtype=torch.float64), "centered_rank")
    assert big[2] < big[0] == big[1]


def test_file_anchor_refuses_a_file_that_changed(tmp_path):
    model = same_shape_model()
    path = str(tmp_path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    anchor = make_anchor(TrainedParameters(select_parameters(model)), "file", [path])
    assert torch.equal(anchor["0.weight"], model[0].weight.detach())
    memory = anchor.materialize()
    assert isinstance(memory, MemoryAnchor) and torch.equal(memory["0.weight"], model[0].weight.detach())
    save_file({k: v.contiguous() + 1 for k, v in model.state_dict().items()}, path)  # overwritten with other values
    with pytest.raises(ValueError, match="changed after training started"):
        anchor["0.weight"]
