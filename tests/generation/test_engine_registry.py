"""A generation engine that holds its own weights, added in one place: a class of ``OwnWeightsEngine`` and one entry
in ``ENGINES``; the trainer builds it, syncs it and puts the members into it by its type."""

import copy

import pytest
import torch
from datasets import Dataset
from oracles import LINEARS
from tiny import build_llama

from trl_es import ESConfig, ESTrainer
from trl_es.es.perturbation import GaussianPerturbation
from trl_es.es.strategy import (
    BatchedLowRankPopulation,
    EngineSequentialPopulation,
    SequentialPopulation,
    on_engine,
)
from trl_es.generation import ENGINES, EagerEngine, OwnWeightsEngine, make_engine
from trl_es.rewards import completion_text


class MirrorEngine(OwnWeightsEngine):
    """The eager engine on its own copy of the model; full-rank members written into the copy from their seeds."""

    name = "mirror"

    def __init__(self, model, share_prompt_prefix=False):
        self.copy = copy.deepcopy(model).eval()
        self.eager = EagerEngine(share_prompt_prefix=share_prompt_prefix)
        self.calls = {"sync": 0, "perturb": 0, "restore": 0}

    @classmethod
    def from_config(cls, config, model, context):
        return cls(model, config.share_prompt_prefix)

    @torch.no_grad()
    def sync_weights(self, model, params, noise):
        self.current = {name: p.detach().clone() for name, p in model.named_parameters()}
        self.masters, self.noise = {e.name: e.master for e in params.entries}, noise
        self.calls["sync"] += 1
        self._load(self.current)

    def perturb_(self, member, sigma):
        own = dict(self.copy.named_parameters())
        self._load({name: GaussianPerturbation.perturbed_tensor(master, self.noise, member, sigma, name,
                                                                own[name].dtype)
                    for name, master in self.masters.items()})
        self.calls["perturb"] += 1

    def restore_(self):
        self._load(self.current)
        self.calls["restore"] += 1

    @torch.no_grad()
    def _load(self, weights):
        own = dict(self.copy.named_parameters())
        for name, value in weights.items():
            own[name].copy_(value)

    def _generate_ids(self, model, processing_class, texts, generation_config, num_row_groups,
                      add_special_tokens=False, **generate_kwargs):
        return self.eager._generate_ids(self.copy, processing_class, texts, generation_config, num_row_groups,
                                        add_special_tokens=add_special_tokens, **generate_kwargs)


@pytest.fixture
def mirror_registered(monkeypatch):
    monkeypatch.setitem(ENGINES, "mirror", MirrorEngine.from_config)  # the one place an engine is registered


def mean_code(completions, **kwargs):
    texts = [completion_text(c) for c in completions]
    return [sum(map(ord, t)) / (128 * max(1, len(t))) for t in texts]


def test_population_goes_into_an_engine_by_its_type(tokenizer, mirror_registered):
    model = build_llama(tokenizer)
    mirror = make_engine("mirror", model, share_prompt_prefix=True)
    assert isinstance(mirror, MirrorEngine) and mirror.eager.share_prompt_prefix
    inside = on_engine(SequentialPopulation(), mirror)
    assert isinstance(inside, EngineSequentialPopulation) and inside.engine is mirror
    assert inside.describe() == {"name": "sequential", "engine": "mirror"}
    outside = SequentialPopulation()
    assert on_engine(outside, EagerEngine()) is outside  # an engine that runs the model takes no members
    lowrank = BatchedLowRankPopulation(noise_rank=2)
    assert on_engine(lowrank, EagerEngine()) is lowrank
    with pytest.raises(ValueError, match=r"The 'mirror' engine takes full-rank members only"):
        on_engine(lowrank, mirror)

    class Incomplete(OwnWeightsEngine):  # restore_ and _generate_ids missing: the ABC refuses it
        def sync_weights(self, model, params, noise): ...

        def perturb_(self, member, sigma): ...

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()


@pytest.mark.parametrize("steps", [1, 2])
def test_a_registered_engine_that_holds_its_weights_trains_as_eager(tmp_path, tokenizer, mirror_registered, steps):
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Write: {i}"}] for i in range(8)]})
    runs = {}
    for name in ("eager", "mirror"):
        args = ESConfig(output_dir=str(tmp_path / name), generation_engine=name, max_steps=steps, population_size=4,
                        antithetic=True, prompt_batch_size=4, max_completion_length=6, sigma=0.05, learning_rate=0.05,
                        report_to=[], save_strategy="no", noise_table_size=1 << 20, disable_tqdm=True, seed=0,
                        include_parameters=LINEARS)
        trainer = ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=data,
                            processing_class=tokenizer)
        trainer.train()
        runs[name] = trainer
    eager, mirror = runs["eager"], runs["mirror"]
    engine = mirror.generation_engine
    assert isinstance(engine, MirrorEngine) and isinstance(mirror.population, EngineSequentialPopulation)
    assert engine.calls == {"sync": steps + 1, "perturb": 4 * steps, "restore": 4 * steps}
    assert mirror.seed_log.header["population_backend"] == {"name": "sequential", "engine": "mirror"}
    assert [r["coefficients"] for r in mirror.seed_log.records] == [r["coefficients"] for r in eager.seed_log.records]
    assert any(c != 0 for r in mirror.seed_log.records for c in r["coefficients"])
    trained = dict(eager.model.named_parameters())
    for name, p in mirror.model.named_parameters():
        assert torch.equal(p, trained[name]), name
    for name, p in engine.copy.named_parameters():  # the engine holds the trained weights after the last sync
        assert torch.equal(p, trained[name]), name
    assert not torch.equal(trained["model.layers.0.mlp.down_proj.weight"],
                           build_llama(tokenizer).model.layers[0].mlp.down_proj.weight)
