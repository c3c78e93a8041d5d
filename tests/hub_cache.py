"""A fake Hugging Face cache: hub model ids and hub dataset ids that resolve, offline, to tiny local data.

Scripts written for the Hub (``AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-0.5B-Instruct")``,
``load_dataset("trl-lib/DeepMath-103K", split="train")``) then run unchanged, through the libraries' own hub code
paths, with nothing downloaded:

- models: transformers' offline mode (``HF_HUB_OFFLINE=1``) reads ``$HF_HOME/hub/models--Org--Name``: ``refs/main``
  holds a commit hash, ``snapshots/<commit>/`` the files (here a tiny model and tokenizer from :mod:`tiny`).
- datasets: ``datasets``' offline mode (``HF_DATASETS_OFFLINE=1``) resolves ``load_dataset("org/Name")`` from its
  own cache, ``$HF_DATASETS_CACHE/org___<snake_name>/<config>/0.0.0/<hash>/`` (``dataset_info.json`` and
  ``<snake_name>-<split>.arrow``). :func:`add_dataset` writes that by loading parquet files once with the
  ``parquet`` builder and renaming its cache directory and files.

Usage::

    home = tmp_path / "hf"
    add_model(home, "Qwen/Qwen2.5-0.5B-Instruct")
    add_dataset(home, "trl-lib/DeepMath-103K", {"train": rows})
    subprocess.run([sys.executable, "script.py"], env={**os.environ, **offline_env(home)})
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from tiny import build_llama, build_qwen2, build_tokenizer, build_vllm_llama

BUILDERS: dict[str, Callable] = {"qwen2": build_qwen2, "llama": build_llama, "llama64": build_vllm_llama}
"""The tiny architectures :func:`add_model` can save, by name (``llama64``: hidden size 64, whole blocks of
bitsandbytes' 4-bit quantization on the CPU)."""


def offline_env(home: str | os.PathLike) -> dict[str, str]:
    """The environment variables that make transformers, huggingface_hub and datasets read ``home`` only, offline."""
    home = Path(home)
    return {
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_DATASETS_CACHE": str(home / "datasets"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }


def fake_commit(repo_id: str) -> str:
    """A stable 40-hex "commit" for ``repo_id`` (the snapshot folder name)."""
    return hashlib.sha1(repo_id.encode()).hexdigest()


def add_model(home: str | os.PathLike, repo_id: str, architecture: str = "llama", seed: int = 0,
              chat_template: str | None = None) -> Path:
    """Save a tiny model and tokenizer as the cached snapshot of the hub model ``repo_id`` under ``home``.

    Args:
        home: The ``HF_HOME`` folder (the hub cache is ``home/hub``).
        repo_id: ``"Org/Name"``, as the script names it.
        architecture: A key of :data:`BUILDERS`. Default ``"llama"`` whatever the id names: ``AutoTokenizer`` loads a
            saved ``qwen2`` checkpoint's tokenizer as ``Qwen2Tokenizer`` (transformers 5), which rebuilds it as a
            byte-level BPE and so does not reproduce :func:`tiny.build_tokenizer` (spaces dropped, one token more
            than the model's vocabulary); a ``llama`` checkpoint's loads as the saved ``TokenizersBackend``.
        seed: Seed of the tiny model's random weights.
        chat_template: A chat template for the tokenizer (e.g. TRL's ``qwen2_5.jinja``, which renders and parses tool
            calls); the model then takes 4096 positions (a prompt with a tool schema is ~900 characters).

    Returns:
        `Path`: The snapshot folder.
    """
    repo = Path(home) / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = fake_commit(repo_id)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    tokenizer = build_tokenizer()
    model = BUILDERS[architecture](tokenizer, seed=seed)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
        model.config.max_position_embeddings = 4096
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    return snapshot


def add_dataset(home: str | os.PathLike, repo_id: str, splits: dict[str, Sequence[dict]],
                config: str = "default") -> Path:
    """Cache ``splits`` (split name -> rows) as the hub dataset ``repo_id`` in ``home/datasets``.

    ``datasets`` offline then answers ``load_dataset(repo_id, split=...)`` (``load_dataset(repo_id, config, ...)``
    for a named ``config``) from it (its "cache" builder, the fallback when the Hub cannot be reached). The hub
    cache gets the empty ``datasets--org--Name`` snapshot folder a download leaves (ESTrainer's model card reads the
    id's case from it).

    Returns:
        `Path`: The cached ``<config>/0.0.0/<hash>`` folder.
    """
    import datasets
    from datasets.naming import camelcase_to_snakecase

    namespace, name = repo_id.split("/")
    snake_name = camelcase_to_snakecase(name)
    with tempfile.TemporaryDirectory() as tmp:
        data_files = {}
        for split, rows in splits.items():
            path = Path(tmp) / f"{split}.parquet"
            datasets.Dataset.from_list(list(rows)).to_parquet(path)
            data_files[split] = str(path)
        build_cache = Path(tmp) / "cache"
        datasets.load_dataset("parquet", data_files=data_files, cache_dir=str(build_cache))
        built = [p for p in (build_cache / "parquet").glob("*/*/*") if p.is_dir()]
        if len(built) != 1:
            raise RuntimeError(f"expected one parquet cache folder under {build_cache}, got {built}")
        version, fingerprint = built[0].parts[-2:]
        target = Path(home) / "datasets" / f"{namespace}___{snake_name}" / config / version / fingerprint
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(built[0], target)
    for file in target.iterdir():
        if file.name.startswith("parquet-"):
            file.rename(target / (snake_name + file.name[len("parquet"):]))
    snapshot = Path(home) / "hub" / f"datasets--{namespace}--{name}" / "snapshots" / fake_commit(repo_id)
    snapshot.mkdir(parents=True, exist_ok=True)  # the hub cache folder a download leaves (it keeps the id's case)
    (snapshot.parent.parent / "refs").mkdir(exist_ok=True)
    (snapshot.parent.parent / "refs" / "main").write_text(fake_commit(repo_id))
    info_path = target / "dataset_info.json"  # the cache builder matches a named config by the info's config_name
    info = json.loads(info_path.read_text())
    info.update(config_name=config, dataset_name=snake_name)
    info_path.write_text(json.dumps(info))
    return target
