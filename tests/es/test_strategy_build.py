"""EvolutionStrategy.build (noise and anchor by their memory rules) and describe (the seed log's header), and a noise
distribution added in one place: a test-local source, registered here, trains and replays."""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from paths import DATA
from tiny import build_llama, build_tokenizer
from trl_es import ESConfig, ESTrainer
from trl_es.es.anchor import FileAnchor, MemoryAnchor
from trl_es.es.noise import (NOISE_BLOCK_SIZE, NOISE_SOURCE_KINDS, DeviceGaussianNoise, GaussianNoise, NoiseSource,
                             NoiseTable, block_key, full_noise, make_noise_source, register_noise_source)
from trl_es.es.perturbation import TrainedParameters, select_parameters
from trl_es.es.seedlog import SeedLog, replay
from trl_es.es.strategy import BatchedLowRankPopulation, EvolutionStrategy, SequentialPopulation


RUNS = os.path.join(DATA, "recorded_runs")
sys.path.insert(0, RUNS)

import make_runs  # noqa: E402


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))


def _params(model):
    return TrainedParameters(select_parameters(model), torch.float32)


def test_build_picks_the_noise_source_by_the_memory_rule():
    build = EvolutionStrategy.build
    table = build(_params(_mlp()), SequentialPopulation(), 0.1, 4, noise_table_size=NOISE_BLOCK_SIZE).noise
    assert type(table) is NoiseTable and table.size == NOISE_BLOCK_SIZE  # full-rank on CPU: the table
    lean = build(_params(_mlp()), SequentialPopulation(), 0.1, 4, noise_table_size=NOISE_BLOCK_SIZE, lean_memory=True)
    assert type(lean.noise) is GaussianNoise  # lean_memory: no table
    lowrank = build(_params(_mlp()), BatchedLowRankPopulation(1, 2), 0.1, 4, noise_table_size=NOISE_BLOCK_SIZE)
    assert type(lowrank.noise) is GaussianNoise
    named = build(_params(_mlp()), SequentialPopulation(), 0.1, 4, noise="device_gaussian")
    assert type(named.noise) is DeviceGaussianNoise
    given = GaussianNoise()
    assert build(_params(_mlp()), SequentialPopulation(), 0.1, 4, noise=given).noise is given
    assert type(make_noise_source(NOISE_BLOCK_SIZE, "auto", "cuda", lean_memory=True)) is DeviceGaussianNoise
    assert type(make_noise_source(NOISE_BLOCK_SIZE, "table", "cpu", lean_memory=True)) is NoiseTable  # only "auto"
    with pytest.raises(ValueError, match=r"noise_source must be one of \('auto', 'table', 'gaussian', "
                                         r"'device_gaussian'\), got 'sobol'"):
        build(_params(_mlp()), SequentialPopulation(), 0.1, 4, noise="sobol")


def test_build_keeps_the_anchor_by_the_memory_rule(tmp_path):
    model = _mlp()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    build = EvolutionStrategy.build
    with pytest.raises(ValueError, match="awd_lambda > 0 needs an anchor: set anchor_storage"):
        build(_params(model), SequentialPopulation(), 0.1, 4, awd_lambda=0.5)
    assert build(_params(model), SequentialPopulation(), 0.1, 4).anchor is None
    memory = build(_params(model), SequentialPopulation(), 0.1, 4, anchor_storage="memory").anchor
    assert isinstance(memory, MemoryAnchor) and memory.resident_bytes == 4 * sum(t.numel() for t in base.values())
    assert all(torch.equal(memory[n], base[n]) for n in base)
    with pytest.warns(UserWarning, match="lean_memory: the base checkpoint file does not hold theta_0"):
        awd = build(_params(model), SequentialPopulation(), 0.1, 4, awd_lambda=0.5, anchor_storage="auto",
                    lean_memory=True)
    assert isinstance(awd.anchor, MemoryAnchor)  # AWD needs theta_0: kept in memory
    drift = build(_params(model), SequentialPopulation(), 0.1, 4, anchor_storage="auto", lean_memory=True)
    assert drift.anchor is None  # drift logging alone: skipped
    path = str(tmp_path / "model.safetensors")
    save_file({n: t.contiguous() for n, t in base.items()}, path)
    filed = build(_params(model), SequentialPopulation(), 0.1, 4, anchor_storage="auto", anchor_files=[path],
                  lean_memory=True).anchor
    assert isinstance(filed, FileAnchor) and filed.resident_bytes == 0
    assert all(torch.equal(filed[n], base[n]) for n in base)


@pytest.mark.parametrize("name", ["lowrank_rank2", "sequential_awd_antithetic", "torch_adamw"])
def test_describe_is_the_recorded_seed_log_header(name, tmp_path):
    with open(os.path.join(RUNS, name, "es_seed_log.jsonl")) as f:
        recorded = json.loads(f.readline())
    tokenizer = build_tokenizer()
    model = build_llama(tokenizer, seed=0)
    model.load_state_dict(load_file(os.path.join(RUNS, name, "base.safetensors")))
    args = ESConfig(output_dir=str(tmp_path), **make_runs.COMMON, **make_runs.RUNS[name])
    trainer = ESTrainer(model, make_runs.mean_code, args=args, train_dataset=make_runs.prompts(),
                        processing_class=tokenizer)
    described = trainer.strategy.describe(args.es_optimizer)
    expected = {k: v for k, v in recorded.items() if k not in ("format", "version", "run_settings")}
    assert json.dumps(described) == json.dumps(expected)  # keys, values and their order: the header's bytes
    assert list(trainer.seed_log.header) == [*described, "run_settings"]
    assert all(trainer.seed_log.header[k] == v for k, v in described.items())


class RademacherNoise(NoiseSource):
    """+-1 with equal odds per element, seeded by ``block_key`` (a distribution defined outside the package)."""

    kind = "test_rademacher"

    def block(self, seed, name, index, length, device):
        generator = torch.Generator().manual_seed(block_key(seed, name, index))
        return (torch.randint(0, 2, (length,), generator=generator) * 2 - 1).to(torch.float32).to(device)


@pytest.fixture
def rademacher():
    register_noise_source(RademacherNoise)  # the one place the new distribution is named
    yield RademacherNoise
    NOISE_SOURCE_KINDS.pop(RademacherNoise.kind)


def test_a_registered_noise_distribution_trains_and_replays(rademacher, tmp_path):
    model = _mlp()
    strategy = EvolutionStrategy.build(_params(model), SequentialPopulation(), 0.05, 4, noise="test_rademacher",
                                       seed=3, antithetic=True)
    assert type(strategy.noise) is RademacherNoise
    assert strategy.describe()["noise"] == {"type": "test_rademacher", "block_size": NOISE_BLOCK_SIZE,
                                            "generator": "numpy-pcg64"}
    eps = full_noise(strategy.noise, 11, "0.weight", (8, 3))
    assert set(eps.unique().tolist()) == {-1.0, 1.0}
    log = SeedLog(header=strategy.describe())
    inputs = torch.linspace(-1, 1, 15).view(5, 3)
    for step in range(2):
        members = strategy.ask(step)
        fitness = []
        for member in members:
            with strategy.apply([member], model):
                fitness.append(model(inputs).sum().item())
        told = strategy.tell(members, torch.tensor(fitness), learning_rate=0.1)
        log.append(step + 1, members, told.coefficients, told.learning_rate, told.shrink)
    log.save(str(tmp_path / "es_seed_log.jsonl"))
    base = _mlp()
    trained = replay(_mlp(), str(tmp_path))
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), base.parameters()))  # it moved
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), trained.parameters()))  # bitwise
    NOISE_SOURCE_KINDS.pop(RademacherNoise.kind)
    try:
        with pytest.raises(ValueError, match="Unknown noise source type 'test_rademacher'"):
            replay(_mlp(), str(tmp_path))
    finally:
        register_noise_source(RademacherNoise)


def test_register_noise_source_refuses_a_kind_it_cannot_own():
    class Auto(RademacherNoise):
        kind = "auto"

    class Table(RademacherNoise):
        kind = "table"

    class Nameless(NoiseSource):
        pass

    for cls in (Auto, Table, Nameless):
        with pytest.raises(ValueError, match="A noise source needs its own kind"):
            register_noise_source(cls)
    assert tuple(NOISE_SOURCE_KINDS) == ("table", "gaussian", "device_gaussian")
