"""ESTrainer trains as it did before the ask/tell refactor: four tiny runs written by the ESTrainer of commit
fef91fa (``tests/data/before_ask_tell/make_runs.py``: full-rank antithetic with AWD, rank-2 batched low-rank in
chunks, sampled completions, the torch-optimizer path with AdamW) are trained again by today's ESTrainer and must
end with bitwise the same weights and the same seed log; their seed logs must replay bitwise."""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from trl_es import replay

HERE = os.path.join(os.path.dirname(__file__), "data", "before_ask_tell")
sys.path.insert(0, HERE)

import make_runs  # noqa: E402


def records(folder):
    with open(os.path.join(folder, "es_seed_log.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    return lines[0], lines[1:]


@pytest.mark.parametrize("name", sorted(make_runs.RUNS))
def test_today_trains_bitwise_as_before(name, tmp_path, one_thread):
    folder = os.path.join(HERE, name)
    base, trained = make_runs.train(name, str(tmp_path))
    expected_base = load_file(os.path.join(folder, "base.safetensors"))
    expected = load_file(os.path.join(folder, "trained.safetensors"))
    assert base.keys() == expected_base.keys() and all(torch.equal(base[k], expected_base[k]) for k in base)
    assert any(not torch.equal(expected[k], expected_base[k]) for k in expected)  # the run moved the weights
    assert trained.keys() == expected.keys()
    for key in expected:
        assert torch.equal(trained[key], expected[key]), key
    header, logged = records(folder)
    new_header, new_logged = records(tmp_path)
    assert new_logged == logged
    for key in ("noise", "sigma", "population_size", "antithetic", "fitness_shaping", "optimizer", "parameters",
                "perturbation", "awd_penalty"):
        assert new_header[key] == header[key], key


@pytest.mark.parametrize("name", sorted(n for n, kw in make_runs.RUNS.items() if kw.get("es_optimizer") != "torch"))
def test_seed_logs_from_before_replay_bitwise(name):
    from tiny import build_llama, build_tokenizer

    folder = os.path.join(HERE, name)
    base = load_file(os.path.join(folder, "base.safetensors"))
    expected = load_file(os.path.join(folder, "trained.safetensors"))
    model = build_llama(build_tokenizer())
    model.load_state_dict(base)
    replay(model, folder)
    state = model.state_dict()
    for key in expected:
        assert torch.equal(state[key], expected[key]), key
