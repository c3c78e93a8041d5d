"""Files written by a multi-process job: by exactly one process (:func:`is_main_process`; a per-process file carries
its rank in its name), completely (:func:`atomic_path`: renamed into place once flushed), checked where a writer
may skip a rank (:func:`require_files`).
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
    """The process's file-mode creation mask (``/proc/self/status``, else ``os.umask`` set and reset)."""
    try:
        with open("/proc/self/status") as f:  # Linux: read the mask without changing it
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and reset at once
    os.umask(mask)
    return mask


def process_rank() -> int:
    """This process's global rank: ``torch.distributed``'s, else ``$RANK``, else 0 (the main process)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())  # torch.distributed's rank once initialised
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return int(os.environ.get("RANK", "0") or 0)  # set by torchrun, accelerate launch, deepspeed


def is_main_process() -> bool:
    """Whether this is the process that writes the job's shared files (global rank 0, see :func:`process_rank`)."""
    return process_rank() == 0


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """A temporary path beside ``path`` (same suffix), renamed onto ``path`` when the block ends without an error.

    Yields:
        `str`: Where to write the bytes. If the block raises, ``path`` is untouched and the temporary file removed.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)  # a missing folder is created
    name = os.path.basename(path)
    stem, suffix = os.path.splitext(name)
    # same folder: the rename is atomic on POSIX; same suffix: format-by-name writers work
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
    """Write ``obj`` as JSON to ``path`` atomically; ``indent`` and ``**json_kwargs`` as :func:`json.dumps`.

    Raises:
        TypeError, ValueError: as :func:`json.dumps`, before ``path`` changes.
    """
    # serialised before anything is written: a bad value leaves path as it was
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
    """The entries of ``names`` that ``folder`` lacks as non-empty files, each as ``"a or b"`` for a tuple, in order."""
    missing = []
    for name in names:
        options = (name,) if isinstance(name, str) else tuple(name)
        if not any(is_present(folder, option) for option in options):
            missing.append(" or ".join(options))
    return missing


def require_files(folder: str | os.PathLike, names: Iterable[str], what: str = "the saved model") -> None:
    """Raise unless every one of ``names`` (a tuple: any one of its options) is a non-empty file in ``folder``.

    Raises:
        RuntimeError: naming ``what``, the missing files, the folder and this process's rank.
    """
    folder = os.fspath(folder)
    # save_pretrained writes nothing on a torch.distributed rank != 0 (should_save_on_this_rank)
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
    """``trainer.save_model(output_dir)`` on every process, then :func:`require_files` where ``args.should_save``.

    Raises:
        RuntimeError: if the writing process finds no weights or no configuration (:data:`SAVED_MODEL_FILES`).
    """
    trainer.save_model(output_dir)  # on every process: ZeRO-3 and FSDP gather the weights on all of them
    if trainer.args.should_save:  # save_pretrained may skip a rank != 0 even when told is_main_process=True
        require_files(output_dir, SAVED_MODEL_FILES, what or f"the model saved by {type(trainer).__name__}")
