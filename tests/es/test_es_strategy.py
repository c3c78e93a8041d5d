"""trl_es.es.strategy.EvolutionStrategy: ask / groups / apply / tell on a plain nn.Module, and ESTrainer built on it."""

import pytest
import torch
from torch import nn

from example_script import example_script
from trl_es.es import make_noise_source, sample_population
from trl_es.es.population import BatchedLowRankPopulation, SequentialPopulation
from trl_es.es.shaping import shape_fitness
from trl_es.es.strategy import EvolutionStrategy
from trl_es.es.update import TrainedParameters, es_update_, select_parameters


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


def test_ask_is_the_population_of_the_step():
    strategy = EvolutionStrategy.for_module(_mlp(), sigma=0.1, population_size=6, seed=7, antithetic=True)
    assert strategy.ask(3) == sample_population(7, 3, 6, antithetic=True)
    assert strategy.ask(3) != strategy.ask(4)
    assert [m.sign for m in strategy.ask(0)] == [1, -1, 1, -1, 1, -1]
    assert strategy.groups(range(6)) == [[0], [1], [2], [3], [4], [5]]


def test_apply_perturbs_and_restores_bitwise_also_on_an_exception():
    model = _mlp()
    base = _weights(model)
    strategy = EvolutionStrategy.for_module(model, sigma=0.1, population_size=4)
    members = strategy.ask(0)
    with strategy.apply([members[0]], model):
        assert not _same(_weights(model), base)
    assert _same(_weights(model), base)
    with pytest.raises(RuntimeError, match="inside a member"):
        with strategy.apply([members[1]], model):
            raise RuntimeError("inside a member")
    assert _same(_weights(model), base)


def test_tell_is_the_es_step_of_the_shaped_fitness_bitwise():
    model, reference = _mlp(), _mlp()
    strategy = EvolutionStrategy.for_module(model, sigma=0.05, population_size=4, fitness_shaping="centered_rank")
    members = strategy.ask(0)
    fitness = torch.tensor([0.1, 0.7, -0.2, 0.4])
    told = strategy.tell(members, fitness, learning_rate=0.01)

    params = TrainedParameters(select_parameters(reference), torch.float32)
    coefficients = shape_fitness(fitness, "centered_rank").tolist()
    es_update_(params, SequentialPopulation().perturbation, make_noise_source(0, "gaussian"), members, coefficients,
               0.01)
    assert told.coefficients == coefficients and told.learning_rate == 0.01 and told.shrink == 0.0
    assert _same(_weights(model), _weights(reference))
    assert not _same(_weights(model), _weights(_mlp()))


def test_constant_fitness_leaves_the_weights_bitwise():
    model = _mlp()
    base = _weights(model)
    strategy = EvolutionStrategy.for_module(model, sigma=0.1, population_size=4)
    told = strategy.tell(strategy.ask(0), torch.full((4,), 0.5), learning_rate=0.1)
    assert told.coefficients == [0.0, 0.0, 0.0, 0.0]
    assert _same(_weights(model), base)


def test_tell_with_a_torch_optimizer_steps_it_and_clears_the_gradients():
    model, reference = _mlp(), _mlp()
    es = EvolutionStrategy.for_module(model, sigma=0.05, population_size=4)
    ref = EvolutionStrategy.for_module(reference, sigma=0.05, population_size=4)
    optimizer = torch.optim.SGD(es.params.master_parameters(), lr=0.01)
    steps = []
    members, fitness = es.ask(0), torch.tensor([0.3, -0.1, 0.9, 0.2])
    es.tell(members, fitness, 0.01, optimizer_step=lambda: (steps.append(1), optimizer.step()))
    ref.tell(members, fitness, 0.01)
    assert steps == [1]
    assert all(m.grad is None for m in es.params.master_parameters())
    for name, tensor in _weights(model).items():  # SGD at lr=alpha is the ES step (up to rounding)
        torch.testing.assert_close(tensor, _weights(reference)[name], rtol=0, atol=1e-7)


def test_awd_pulls_toward_the_anchor_and_is_recorded():
    model = _mlp()
    base = _weights(model)
    plain = _mlp()
    awd = EvolutionStrategy.for_module(model, sigma=0.05, population_size=4, awd_lambda=2.0)
    ref = EvolutionStrategy.for_module(plain, sigma=0.05, population_size=4)
    members, fitness = awd.ask(0), torch.tensor([0.3, -0.1, 0.9, 0.2])
    told = awd.tell(members, fitness, 0.05)
    ref.tell(members, fitness, 0.05)
    assert told.shrink == pytest.approx(0.1)
    drift = sum(float((_weights(model)[n] - base[n]).norm()) for n in base)
    plain_drift = sum(float((_weights(plain)[n] - base[n]).norm()) for n in base)
    assert drift == pytest.approx(0.9 * plain_drift, rel=1e-5)  # l2: delta * (1 - alpha * lambda)


def test_awd_without_an_anchor_is_refused_before_the_weights_change():
    model = _mlp()
    base = _weights(model)
    strategy = EvolutionStrategy.for_module(model, sigma=0.1, population_size=4)
    strategy.awd_lambda = 0.5
    with pytest.raises(ValueError, match="awd_lambda > 0 needs an anchor"):
        strategy.tell(strategy.ask(0), torch.tensor([0.0, 1.0, 2.0, 3.0]), 0.1)
    assert _same(_weights(model), base)


def test_batched_lowrank_groups_apply_adapters_without_writing_the_weights():
    model = _mlp()
    base = _weights(model)
    params = TrainedParameters(select_parameters(model, r"weight$"), torch.float32, share_params=True)
    strategy = EvolutionStrategy(params, make_noise_source(0, "gaussian"), BatchedLowRankPopulation(1, 2), 0.1, 4)
    members = strategy.ask(0)
    assert strategy.groups(range(4)) == [[0, 1], [2, 3]]
    x = torch.randn(4, 3)
    plain = model(x)
    with strategy.apply([members[0], members[1]], model):
        perturbed = model(x)
        assert _same(_weights(model), base)
    assert not torch.equal(perturbed, plain)
    assert torch.equal(model(x), plain)


def test_es_xor_example_learns_xor():
    with example_script("scripts/es_xor.py", "es_xor_example") as script:
        result = script.main(["--iterations", "150"])
    assert result["accuracy"] == 1.0
    assert result["fitness"] > result["start_fitness"] + 0.15


def test_estrainer_holds_its_es_state_in_the_strategy():
    from datasets import Dataset

    from tiny import build_llama, build_tokenizer, content_reward
    from trl_es import ESConfig, ESTrainer

    tokenizer = build_tokenizer()
    args = ESConfig(output_dir="unused", population_size=4, sigma=0.01, max_steps=1, prompt_batch_size=2,
                    max_completion_length=2, report_to="none", save_strategy="no", seed=3, antithetic=True,
                    use_cpu=True)
    trainer = ESTrainer(build_llama(tokenizer), content_reward, args=args, processing_class=tokenizer,
                        train_dataset=Dataset.from_dict({"prompt": ["ab", "cd"]}))
    strategy = trainer.strategy
    assert isinstance(strategy, EvolutionStrategy)
    assert trainer.es_params is strategy.params and trainer.noise is strategy.noise
    assert trainer.population is strategy.population
    assert (strategy.sigma, strategy.population_size, strategy.seed, strategy.antithetic) == (0.01, 4, 3, True)
    assert strategy.ask(0) == sample_population(3, 0, 4, antithetic=True)
