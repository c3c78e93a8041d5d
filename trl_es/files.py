"""Files written by a multi-process job: by exactly one process, completely.

Two rules, for every file trl_es or its scripts write under a launcher (``torchrun``, ``accelerate launch``,
``deepspeed``, :mod:`trl_es.launch`):

- **one writer**: a file every process could write is written by the main process only (:func:`is_main_process`);
  a per-process file (a ZeRO-3 shard) carries its rank in its name;
- **complete or absent**: the bytes go to a temporary file in the same folder, which is renamed over the target
  only once it is fully written and flushed (:func:`atomic_path`). A reader never sees half a file, and a crash
  leaves the previous version (or nothing), never a truncated one.

Writers that decide to skip on some ranks (``transformers``' ``save_pretrained`` writes nothing on a
``torch.distributed`` rank != 0) are checked after the fact where trl_es relies on them: :func:`require_files`
raises instead of leaving a folder that only looks complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator


__all__ = ["SAVED_MODEL_FILES", "atomic_path", "current_umask", "is_main_process", "process_rank", "require_files",
           "save_figure", "save_trainer_model", "write_json", "write_text"]


def current_umask() -> int:
    """The process's file-mode creation mask, read without changing it where Linux says it (``/proc/self/status``);
    elsewhere set and reset at once (``os.umask``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def process_rank() -> int:
    """This process's global rank: ``torch.distributed``'s when it is initialised, else the launcher's ``RANK``
    environment variable (set by ``torchrun``, ``accelerate launch``, ``deepspeed``), else 0.

    Returns:
        `int`: 0 for the main (or only) process.
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return int(os.environ.get("RANK", "0") or 0)


def is_main_process() -> bool:
    """Whether this is the process that writes the job's shared files (global rank 0, see :func:`process_rank`)."""
    return process_rank() == 0


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """A temporary path beside ``path``; renamed onto ``path`` when the ``with`` block ends without an exception.

    The temporary file is in the same folder (so the rename is atomic on POSIX), its name keeps ``path``'s suffix
    (writers that infer the format from the name still work), and it is removed if the block raises. The folder is
    created if missing.

    Args:
        path (`str | os.PathLike`): The file to (re)write.

    Yields:
        `str`: Where to write the bytes.

    Raises:
        Exception: Whatever the block raises (``path`` is then untouched).
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    name = os.path.basename(path)
    stem, suffix = os.path.splitext(name)
    handle, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=f".tmp{suffix}", dir=folder)
    os.close(handle)
    os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes it 0600; the file gets the permissions open() would give
    try:
        yield tmp
        with open(tmp, "rb+") as f:  # the bytes reach the disk before the rename makes them visible
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_path`)."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def write_json(path: str | os.PathLike, obj, indent: int | None = 2, **json_kwargs) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (:func:`atomic_path`).

    The object is serialised before anything is written, so an unserialisable value (``TypeError``) or a NaN with
    ``allow_nan=False`` (``ValueError``) leaves ``path`` as it was.

    Args:
        path (`str | os.PathLike`): The JSON file.
        obj (`Any`): A JSON-serialisable object.
        indent (`int`, *optional*, defaults to 2): As :func:`json.dumps`.
        **json_kwargs (`Any`): Passed to :func:`json.dumps` (``default=``, ``allow_nan=``, ``sort_keys=``...).
    """
    write_text(path, json.dumps(obj, indent=indent, **json_kwargs) + "\n")


def save_figure(fig, path: str | os.PathLike, **savefig_kwargs) -> None:
    """``fig.savefig(path)`` atomically; the format comes from ``path``'s extension (``.png``, ``.pdf``, ...)."""
    fmt = os.path.splitext(os.fspath(path))[1].lstrip(".")
    if not fmt:  # no extension: matplotlib's default format (it would read the temporary name's ".tmp" otherwise)
        import matplotlib

        fmt = matplotlib.rcParams["savefig.format"]
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=fmt, **savefig_kwargs)


def is_present(folder: str | os.PathLike, name: str) -> bool:
    """Whether ``folder/name`` exists as a non-empty file."""
    file = os.path.join(os.fspath(folder), name)
    return os.path.isfile(file) and os.path.getsize(file) > 0


def missing_files(folder: str | os.PathLike, names: Iterable[str | tuple[str, ...]]) -> list[str]:
    """The entries of ``names`` that ``folder`` lacks as non-empty files (a tuple: none of its options is there),
    each as ``"a or b"``.

    Returns:
        `list[str]`: In the order of ``names``; empty when nothing is missing.
    """
    missing = []
    for name in names:
        options = (name,) if isinstance(name, str) else tuple(name)
        if not any(is_present(folder, option) for option in options):
            missing.append(" or ".join(options))
    return missing


def require_files(folder: str | os.PathLike, names: Iterable[str], what: str = "the saved model") -> None:
    """Raise unless every one of ``names`` exists in ``folder`` as a non-empty file (at least one of a tuple).

    For writers that may skip silently: ``transformers``' ``save_pretrained`` writes no weights on a
    ``torch.distributed`` rank != 0 (``should_save_on_this_rank``), e.g. the first process of a second node with
    ``save_on_each_node=True``.

    Args:
        folder (`str | os.PathLike`): The folder that was written.
        names (`Iterable[str | tuple[str, ...]]`): File names; a tuple means "any one of these" (e.g.
            ``("model.safetensors", "model.safetensors.index.json")``).
        what (`str`): Named in the error.

    Raises:
        RuntimeError: naming the missing files, the folder and this process's rank.
    """
    folder = os.fspath(folder)
    missing = missing_files(folder, names)
    if missing:
        raise RuntimeError(
            f"{what} in {folder!r} is incomplete: {missing} missing or empty after writing it on process rank "
            f"{process_rank()}. (transformers' save_pretrained writes nothing on a torch.distributed rank != 0; "
            "write from the main process.)"
        )


# ---------------------------------------------------------------------------------------------- saved models
#: What a folder written by ``save_pretrained`` / ``Trainer.save_model`` must hold (for
#: :func:`trl_es.files.require_files`): the weights (one file, the index of the shards, or a peft adapter) and the
#: configuration (the model's, or the adapter's).
SAVED_MODEL_FILES = (
    ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors"),
    ("config.json", "adapter_config.json"),
)


def save_trainer_model(trainer, output_dir: str, what: str | None = None) -> None:
    """``trainer.save_model(output_dir)``, then, on the process that wrote it (``args.should_save``), a check that the
    folder holds a model (:data:`SAVED_MODEL_FILES`).

    Call it on every process (under ZeRO-3 or FSDP the weights are gathered by all of them). ``save_pretrained``
    writes no weights on a ``torch.distributed`` rank != 0 even when told ``is_main_process=True`` (the first process
    of a second node with ``save_on_each_node``): this turns that into an error instead of a folder that only looks
    complete.

    Args:
        trainer (`transformers.Trainer`): Any trainer (``ESTrainer``, TRL's ``GRPOTrainer``, ...).
        output_dir (`str`): Where to save.
        what (`str`, *optional*): Named in the error (default: the trainer's class).

    Raises:
        RuntimeError: if the writing process finds no weights or no configuration in ``output_dir`` afterwards.
    """
    trainer.save_model(output_dir)
    if trainer.args.should_save:
        require_files(output_dir, SAVED_MODEL_FILES, what or f"the model saved by {type(trainer).__name__}")
