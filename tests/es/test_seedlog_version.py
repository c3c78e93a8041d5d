"""The seed-log format's version says which noise generator and arithmetic a run was trained with
(trl_es.es.seedlog.VERSIONS): version 1 logs (the recorded runs, and the older ones without a ``"generator"``) read and
replay as before, a new log is version 2, and a version this trl_es does not know is refused by name."""

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from trl_es import replay
from trl_es.es import Member
from trl_es.es.noise import LEGACY_GENERATOR, PORTABLE_GENERATOR, noise_source_from_description
from trl_es.es.seedlog import SEED_LOG_NAME, VERSION, VERSIONS, SeedLog

from paths import DATA

RECORDED = os.path.join(DATA, "recorded_runs", "sequential_awd_antithetic")  # version 1, NumPy PCG64 noise
LEGACY = os.path.join(DATA, "legacy_seedlogs", "sequential_bf16")  # version 1, no "generator": torch.randn


def lines(folder):
    with open(os.path.join(folder, SEED_LOG_NAME)) as f:
        return [json.loads(line) for line in f]


def write_log(folder, header_line, records):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, SEED_LOG_NAME), "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in [header_line, *records])
    return str(folder)


def replayed(folder):
    from tiny import build_llama, build_tokenizer

    base = load_file(os.path.join(RECORDED, "base.safetensors"))
    model = build_llama(build_tokenizer())
    model.load_state_dict(base)
    replay(model, folder)
    return model.state_dict()


def assert_trained_as_recorded(state):
    expected = load_file(os.path.join(RECORDED, "trained.safetensors"))
    for key in expected:
        assert torch.equal(state[key], expected[key]), key


def test_the_versions_say_generator_and_arithmetic():
    assert VERSION == 2 and sorted(VERSIONS) == [1, 2]
    assert PORTABLE_GENERATOR in VERSIONS[2] and "arithmetic" in VERSIONS[2]
    assert PORTABLE_GENERATOR in VERSIONS[1] and LEGACY_GENERATOR in VERSIONS[1]


def test_a_version_1_log_reads_as_version_1_and_replays_bitwise(one_thread):
    assert lines(RECORDED)[0]["version"] == 1
    log = SeedLog.load(RECORDED)
    assert log.version == 1 and log.header["noise"]["generator"] == PORTABLE_GENERATOR
    assert_trained_as_recorded(replayed(RECORDED))


def test_an_old_version_1_log_keeps_its_legacy_generator_when_saved_again(tmp_path):
    log = SeedLog.load(LEGACY)
    assert log.version == 1 and "generator" not in log.header["noise"]
    assert not noise_source_from_description(log.header["noise"]).portable  # torch.randn, fused kernels
    log.save(str(tmp_path / SEED_LOG_NAME))
    again = lines(tmp_path)
    assert again[0]["version"] == 1 and "generator" not in again[0]["noise"]  # not relabelled as version 2
    assert again == lines(LEGACY)


def test_a_new_log_says_version_2_and_replays_the_same_bits(tmp_path, one_thread):
    header_line, *records = lines(RECORDED)
    header = {k: v for k, v in header_line.items() if k not in ("format", "version")}
    log = SeedLog(header=header)
    for record in records:
        log.append(record["step"], [Member(seed, sign) for seed, sign in record["members"]],
                   record["coefficients"], record["learning_rate"], record["awd_shrink"])
    log.save(str(tmp_path / SEED_LOG_NAME))
    written = lines(tmp_path)
    assert written[0]["format"] == "trl_es.seedlog" and written[0]["version"] == 2
    assert written[1:] == records
    assert SeedLog.load(str(tmp_path)).version == 2
    assert_trained_as_recorded(replayed(str(tmp_path)))


def test_a_version_2_log_is_trained_with_the_portable_generator(tmp_path, one_thread):
    header_line, *records = lines(RECORDED)
    unnamed = {**header_line, "version": 2, "noise": {k: v for k, v in header_line["noise"].items()
                                                      if k != "generator"}}
    folder = write_log(tmp_path / "unnamed", unnamed, records)
    assert SeedLog.load(folder).header["noise"]["generator"] == PORTABLE_GENERATOR  # the version's generator
    assert_trained_as_recorded(replayed(folder))
    legacy = {**header_line, "version": 2, "noise": {**header_line["noise"], "generator": LEGACY_GENERATOR}}
    folder = write_log(tmp_path / "legacy", legacy, records)
    with pytest.raises(ValueError, match=r"version-2 seed log is trained with noise generator 'numpy-pcg64', but "
                                         r"its header names 'torch'"):
        SeedLog.load(folder)


@pytest.mark.parametrize("version", [0, 3, "2", True, None])
def test_an_unknown_version_is_refused_naming_the_supported_ones(tmp_path, version):
    header_line, *records = lines(RECORDED)
    folder = write_log(tmp_path, {**header_line, "version": version}, records)
    with pytest.raises(ValueError, match=re.escape(f"is a trl_es seed log of version {version!r}; this trl_es reads "
                                                   "versions [1, 2]")):
        SeedLog.load(folder)
    with pytest.raises(ValueError, match="reads versions"):
        replay(torch.nn.Linear(1, 1), folder)
