"""ESTrainer trains as recorded: four tiny runs (``tests/data/recorded_runs/make_runs.py``: full-rank antithetic
with AWD, rank-2 batched low-rank in chunks, sampled completions, the torch-optimizer path with AdamW) are trained
again by today's ESTrainer and must end as recorded, on any x86-64 CPU.

What is compared bitwise with the recording is what is the same on every CPU: the base weights (data, not
initialised here), the seed logs, the trained weights of the ES runs (portable noise and arithmetic,
:mod:`trl_es.es.perturbation`) and their replay. What depends on the CPU, torch's AdamW kernels, is compared bitwise
with a reference computed on this machine by an independent path (the ES gradient from the seed log and a plain
``torch.optim`` loop), and with the recording to a float32 tolerance. ``tests/es/test_portability.py`` runs the ES
runs again with torch's CPU dispatch forced to ``default`` and ``avx2``.
"""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from trl_es import ESConfig, replay
from trl_es.es import GaussianPerturbation, Member, TrainedParameters, es_gradient_
from trl_es.es.noise import noise_source_from_description
from paths import DATA

HERE = os.path.join(DATA, "recorded_runs")
sys.path.insert(0, HERE)

import make_runs  # noqa: E402

ES_RUNS = sorted(n for n, kw in make_runs.RUNS.items() if kw.get("es_optimizer") != "torch")


def records(folder):
    with open(os.path.join(folder, "es_seed_log.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    return lines[0], lines[1:]


def recorded(name):
    folder = os.path.join(HERE, name)
    return load_file(os.path.join(folder, "base.safetensors")), load_file(os.path.join(folder, "trained.safetensors"))


@pytest.mark.parametrize("name", sorted(make_runs.RUNS))
def test_today_trains_as_recorded(name, tmp_path, one_thread):
    folder = os.path.join(HERE, name)
    base, trained = make_runs.train(name, str(tmp_path))
    expected_base, expected = recorded(name)
    assert base.keys() == expected_base.keys() and all(torch.equal(base[k], expected_base[k]) for k in base)
    assert any(not torch.equal(expected[k], expected_base[k]) for k in expected)  # the run moved the weights
    header, logged = records(folder)
    new_header, new_logged = records(tmp_path)
    assert new_logged == logged  # seeds, coefficients, learning rates: the same completions were scored
    for key in ("noise", "sigma", "population_size", "antithetic", "fitness_shaping", "optimizer", "parameters",
                "perturbation", "awd_penalty"):
        assert new_header[key] == header[key], key
    assert header["noise"]["generator"] == "numpy-pcg64"
    assert trained.keys() == expected.keys()
    if name in ES_RUNS:
        for key in expected:
            assert torch.equal(trained[key], expected[key]), key
    else:  # torch's AdamW kernels round differently on different CPUs: bitwise against this machine's reference
        reference = independent_optimizer_run(name, base, logged)
        for key in expected:
            assert torch.equal(trained[key], reference[key]), key
            torch.testing.assert_close(trained[key], expected[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ES_RUNS)
def test_recorded_seed_logs_replay_bitwise(name):
    from tiny import build_llama, build_tokenizer

    base, expected = recorded(name)
    model = build_llama(build_tokenizer())
    model.load_state_dict(base)
    replay(model, os.path.join(HERE, name))
    state = model.state_dict()
    for key in expected:
        assert torch.equal(state[key], expected[key]), key


def independent_optimizer_run(name, base, logged):
    """The torch-optimizer run without ESTrainer: the ES gradient of each logged iteration (seeds and coefficients,
    :func:`trl_es.es.es_gradient_`) stepped by the optimizer ``Trainer`` builds for the run's ESConfig, at the logged
    learning rate. Returns the trained state dict."""
    from transformers import Trainer

    from tiny import build_llama, build_tokenizer

    config = {**make_runs.COMMON, **make_runs.RUNS[name]}
    model = build_llama(build_tokenizer())
    model.load_state_dict(base)
    params = TrainedParameters(list(model.named_parameters()), torch.float32)
    optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(ESConfig(output_dir="unused", **config))
    optimizer = optimizer_cls([{"params": params.master_parameters(), "weight_decay": 0.0}], **optimizer_kwargs)
    header, _ = records(os.path.join(HERE, name))
    noise = noise_source_from_description(header["noise"])
    for record in logged:
        members = [Member(seed, sign) for seed, sign in record["members"]]
        es_gradient_(params, GaussianPerturbation(), noise, members, record["coefficients"])
        for group in optimizer.param_groups:
            group["lr"] = record["learning_rate"]
        optimizer.step()
        params.write_master_to_model_()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
