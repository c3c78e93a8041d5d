"""trl_es.es.strategy.EvolutionStrategy: ask / groups / apply / tell on a plain nn.Module, and ESTrainer built on it."""

import re

import pytest
import torch
from torch import nn

from example_script import example_script
from trl_es.es import make_noise_source, sample_population
from trl_es.es.fitness import shape_fitness
from trl_es.es.perturbation import TrainedParameters, es_update_, select_parameters
from trl_es.es.strategy import BatchedLowRankPopulation, EvolutionStrategy, SequentialPopulation


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
    assert strategy.chunks(range(6)) == [[0], [1], [2], [3], [4], [5]]


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
    assert strategy.chunks(range(4)) == [[0, 1], [2, 3]]
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


# ---------------------------------------------------------------- weights written into the module outside the strategy
def _reference_step(model, masters, members, fitness, learning_rate, shaping="zscore"):
    """The weights ``model`` ends with after one ES step from ``masters`` (fp32 by name), built from scratch."""
    params = TrainedParameters(select_parameters(model), torch.float32)
    params.load_master_state_dict(masters)
    es_update_(params, SequentialPopulation().perturbation, make_noise_source(0, "gaussian"), members,
               shape_fitness(fitness, shaping).tolist(), learning_rate)
    return _weights(model)


def _load_other(model, dtype):
    model.load_state_dict(_mlp(seed=1).to(dtype).state_dict())


def _load_other_assigned(model, dtype):
    model.load_state_dict(_mlp(seed=1).to(dtype).state_dict(), assign=True)


def _copy_into_one(model, dtype):
    model[2].weight.data.copy_(torch.linspace(-1, 1, 16).view(2, 8))


def _add_in_place(model, dtype):
    with torch.no_grad():
        model[0].bias.add_(0.25)


CHANGES = {"load_state_dict": _load_other, "load_state_dict_assign": _load_other_assigned,
           "data_copy": _copy_into_one, "no_grad_add": _add_in_place}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("change", list(CHANGES))
def test_weights_put_into_the_module_are_restored_by_apply_and_stepped_from_by_tell(change, dtype):
    model = _mlp().to(dtype)
    strategy = EvolutionStrategy.for_module(model, sigma=0.05, population_size=4)
    fitness = torch.tensor([0.1, 0.7, -0.2, 0.4])
    strategy.tell(strategy.ask(0), fitness, learning_rate=0.01)  # a 16-bit model's master now holds sub-ulp steps
    old_masters = {n: t.clone() for n, t in strategy.params.master_state_dict().items()}
    assert strategy.sync_with_module() == []  # what the strategy wrote itself is no change

    CHANGES[change](model, dtype)
    loaded = _weights(model)
    differs = [n for n in loaded if not torch.equal(loaded[n], old_masters[n].to(dtype))]
    assert differs == (["0.bias"] if change == "no_grad_add" else ["2.weight"] if change == "data_copy"
                       else list(loaded))
    members = strategy.ask(1)
    with strategy.apply([members[0]], model):
        assert not _same(_weights(model), loaded)
    assert _same(_weights(model), loaded)  # what the module held on entry, bitwise
    with strategy.apply([members[1]], model):
        pass
    assert _same(_weights(model), loaded)

    # the master: the module's new values (exactly, in fp32) where they changed, the old fp32 master elsewhere
    expected = {n: loaded[n].float() if n in differs else old_masters[n] for n in loaded}
    assert all(torch.equal(strategy.params.master_state_dict()[n], expected[n]) for n in loaded)
    strategy.tell(members, torch.tensor([0.3, -0.1, 0.9, 0.2]), learning_rate=0.01)
    stepped = _reference_step(_mlp().to(dtype), expected, members, torch.tensor([0.3, -0.1, 0.9, 0.2]), 0.01)
    assert _same(_weights(model), stepped)
    assert not _same(_weights(model), loaded)


@pytest.mark.parametrize("change", ["load_state_dict", "data_copy"])
def test_tell_steps_from_loaded_weights_also_with_a_torch_optimizer_and_without_a_module(change):
    model, fresh = _mlp(), _mlp()
    params = TrainedParameters(select_parameters(model), torch.float32)  # built by hand: no module to look up
    strategy = EvolutionStrategy(params, make_noise_source(0, "gaussian"), SequentialPopulation(), 0.05, 4)
    optimizer = torch.optim.SGD(strategy.params.master_parameters(), lr=0.01)
    CHANGES[change](model, torch.float32)
    CHANGES[change](fresh, torch.float32)
    reference = EvolutionStrategy.for_module(fresh, sigma=0.05, population_size=4)
    reference_optimizer = torch.optim.SGD(reference.params.master_parameters(), lr=0.01)
    members, fitness = strategy.ask(0), torch.tensor([0.3, -0.1, 0.9, 0.2])
    strategy.tell(members, fitness, 0.01, optimizer_step=optimizer.step)
    reference.tell(members, fitness, 0.01, optimizer_step=reference_optimizer.step)
    assert _same(_weights(model), _weights(fresh))
    assert optimizer.param_groups[0]["params"][0] is strategy.params.master_parameters()[0]  # re-read in place


def test_lowrank_strategy_whose_master_is_the_weight_steps_from_loaded_weights():
    model, fresh = _mlp(), _mlp(seed=1)
    params = TrainedParameters(select_parameters(model, r"weight$"), torch.float32, share_params=True)
    strategy = EvolutionStrategy(params, make_noise_source(0, "gaussian"), BatchedLowRankPopulation(1, 2), 0.1, 4,
                                 module=model)
    model.load_state_dict(fresh.state_dict())
    assert strategy.sync_with_module() == []  # the weights are the master: nothing to re-read
    reference = EvolutionStrategy(TrainedParameters(select_parameters(fresh, r"weight$"), torch.float32,
                                                    share_params=True),
                                  make_noise_source(0, "gaussian"), BatchedLowRankPopulation(1, 2), 0.1, 4)
    members, fitness = strategy.ask(0), torch.tensor([0.3, -0.1, 0.9, 0.2])
    strategy.tell(members, fitness, 0.01)
    reference.tell(members, fitness, 0.01)
    assert _same(_weights(model), _weights(fresh))


def test_a_model_cast_after_the_strategy_is_followed_keeping_the_fp32_master():
    model = _mlp()
    strategy = EvolutionStrategy.for_module(model, sigma=0.05, population_size=4)
    strategy.tell(strategy.ask(0), torch.tensor([0.1, 0.7, -0.2, 0.4]), 0.01)
    masters = {n: t.clone() for n, t in strategy.params.master_state_dict().items()}
    model.half()  # new fp16 storage, values cast(master): followed, not a change
    half = _weights(model)
    with strategy.apply([strategy.ask(1)[0]]):  # the module is the default model
        assert not _same(_weights(model), half)
    assert _same(_weights(model), half) and all(t.dtype == torch.float16 for t in half.values())
    assert all(torch.equal(strategy.params.master_state_dict()[n], masters[n]) for n in masters)
    assert [e.param.data_ptr() for e in strategy.params.entries] == [p.data_ptr() for p in model.parameters()]


def test_a_write_inside_apply_is_undone_with_the_member():
    model = _mlp()
    base = _weights(model)
    strategy = EvolutionStrategy.for_module(model, sigma=0.1, population_size=4)
    with strategy.apply([strategy.ask(0)[0]], model):
        _load_other(model, torch.float32)
    assert _same(_weights(model), base)
    assert strategy.sync_with_module() == []


@pytest.mark.parametrize("change,names", [("load_state_dict", ["0.weight", "0.bias", "2.weight", "2.bias"]),
                                          ("no_grad_add", ["0.bias"])])
def test_on_module_change_raise_names_the_tensors_and_changes_nothing(change, names):
    model = _mlp()
    strategy = EvolutionStrategy.for_module(model, sigma=0.1, population_size=4, on_module_change="raise")
    masters = {n: t.clone() for n, t in strategy.params.master_state_dict().items()}
    CHANGES[change](model, torch.float32)
    loaded = _weights(model)
    with pytest.raises(ValueError, match=re.escape(f"trained tensors {names} no longer hold")):
        with strategy.apply([strategy.ask(0)[0]], model):
            pytest.fail("applied a member on weights the strategy does not hold")
    with pytest.raises(ValueError, match=re.escape(repr(names))):
        strategy.tell(strategy.ask(0), torch.tensor([0.0, 1.0, 2.0, 3.0]), 0.1)
    assert _same(_weights(model), loaded)
    assert all(torch.equal(strategy.params.master_state_dict()[n], masters[n]) for n in masters)


def test_on_module_change_ignore_keeps_the_master_and_unknown_rules_are_refused():
    model = _mlp()
    base = _weights(model)
    strategy = EvolutionStrategy.for_module(model, sigma=0.1, population_size=4, on_module_change="ignore")
    _load_other(model, torch.float32)
    with strategy.apply([strategy.ask(0)[0]], model):
        pass
    assert _same(_weights(model), base)  # the caller keeps the master in step itself (ESTrainer)
    with pytest.raises(ValueError, match=r"on_module_change must be one of \('reread', 'raise', 'ignore'\), got 'x'"):
        EvolutionStrategy.for_module(model, sigma=0.1, population_size=4, on_module_change="x")


@pytest.mark.parametrize("replace,message", [
    (lambda m: setattr(m[2], "weight", nn.Parameter(torch.zeros(2, 9))), r"'2\.weight' is now \(2, 9\)"),
    (lambda m: setattr(m[0], "bias", nn.Parameter(torch.zeros(16)[::2])), r"'0\.bias' is now \(8,\) .*contiguous: "
                                                                            r"False"),
    (lambda m: delattr(m[0], "bias"), r"no longer has the trained parameter '0\.bias'"),
])
def test_a_trained_tensor_reshaped_or_removed_is_refused_by_name(replace, message):
    model = _mlp()
    strategy = EvolutionStrategy.for_module(model, sigma=0.1, population_size=4)
    masters = {n: t.clone() for n, t in strategy.params.master_state_dict().items()}
    replace(model)
    with pytest.raises(ValueError, match=message):
        strategy.tell(strategy.ask(0), torch.tensor([0.0, 1.0, 2.0, 3.0]), 0.1)
    assert all(torch.equal(strategy.params.master_state_dict()[n], masters[n]) for n in masters)


# ---------------------------------------------------------------- tell's inputs
@pytest.mark.parametrize("fitness,shape", [
    (torch.tensor([0.1, 0.2, 0.3]), "(3,) (3 values)"),
    (torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]), "(5,) (5 values)"),
    (torch.tensor([[0.1], [0.2], [0.3], [0.4]]), "(4, 1) (4 values)"),
    (torch.tensor([[0.1, 0.2], [0.3, 0.4]]), "(2, 2) (4 values)"),
    (torch.tensor(0.5), "() (1 values)"),
    ([0.1, 0.2, 0.3], "(3,) (3 values)"),
])
def test_tell_with_a_fitness_not_one_value_per_member_names_both_and_changes_nothing(fitness, shape):
    model = _mlp()
    base = _weights(model)
    strategy = EvolutionStrategy.for_module(model, sigma=0.1, population_size=4)
    with pytest.raises(ValueError, match=re.escape(f"fitness has shape {shape} for 4 members: tell needs one value "
                                                   "per member of ask(), shape (4,)")):
        strategy.tell(strategy.ask(0), fitness, 0.1)
    assert _same(_weights(model), base)


@pytest.mark.parametrize("members,fitness,message", [
    ([0, 1, 2, 3], torch.zeros(4), r"a sequence of at least 2 Member, got 4 of \['int'\]"),
    ("one", torch.zeros(1), r"at least 2 Member, got 3 of \['str'\]"),
    (None, torch.tensor([True, False, True, False]), r"fitness must be real numbers, got dtype torch\.bool"),
    (None, torch.ones(4, dtype=torch.complex64), r"fitness must be real numbers, got dtype torch\.complex64"),
    (None, [[0.1, 0.2], [0.3]], r"fitness must be one real value per member \(4 members\)"),
])
def test_tell_refuses_members_and_fitness_of_the_wrong_kind(members, fitness, message):
    model = _mlp()
    base = _weights(model)
    strategy = EvolutionStrategy.for_module(model, sigma=0.1, population_size=4)
    with pytest.raises(ValueError, match=message):
        strategy.tell(strategy.ask(0) if members is None else members, fitness, 0.1)
    assert _same(_weights(model), base)


@pytest.mark.parametrize("learning_rate", [float("nan"), float("inf"), "0.1", None])
def test_tell_refuses_a_learning_rate_that_is_not_a_finite_number(learning_rate):
    model = _mlp()
    base = _weights(model)
    strategy = EvolutionStrategy.for_module(model, sigma=0.1, population_size=4)
    with pytest.raises(ValueError, match=re.escape(f"learning_rate must be a finite number, got {learning_rate!r}")):
        strategy.tell(strategy.ask(0), torch.tensor([0.0, 1.0, 2.0, 3.0]), learning_rate)
    assert _same(_weights(model), base)


def test_tell_takes_a_numpy_learning_rate_and_fitness_as_a_python_float_and_list():
    import numpy as np

    model, reference = _mlp(), _mlp()
    strategy = EvolutionStrategy.for_module(model, sigma=0.05, population_size=4)
    members = strategy.ask(0)
    strategy.tell(members, np.array([0.1, 0.7, -0.2, 0.4]), np.float32(0.25))
    EvolutionStrategy.for_module(reference, sigma=0.05, population_size=4).tell(
        members, torch.tensor([0.1, 0.7, -0.2, 0.4], dtype=torch.float64), float(np.float32(0.25)))
    assert _same(_weights(model), _weights(reference))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_tell_ranks_a_non_finite_fitness_worst(bad, caplog):
    as_list = EvolutionStrategy.for_module(_mlp(), sigma=0.1, population_size=4, fitness_shaping="centered_rank")
    told = as_list.tell(as_list.ask(0), [0.2, bad, 0.9, 0.4], 0.1)  # a list is taken as the tensor
    assert told.coefficients == [1 / 3 - 0.5, -0.5, 0.5, 2 / 3 - 0.5]  # ranks 1, 0 (worst), 3, 2
    assert "1 of 4 population members have no finite fitness" in caplog.text
