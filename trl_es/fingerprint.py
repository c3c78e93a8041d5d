"""Content hashes of tensors: equal fingerprints mean bitwise-equal tensors (up to SHA-256 collisions)."""

from __future__ import annotations

import hashlib  # a leaf module (hashlib and torch only), so that any room can import it
from collections.abc import Iterable, Mapping

import torch
from torch import nn


__all__ = ["tensors_fingerprint", "weights_fingerprint"]


def tensors_fingerprint(tensors: Mapping[str, torch.Tensor] | Iterable[torch.Tensor], digest_size: int = 32) -> bytes:
    """SHA-256 of the tensors' names, dtypes, shapes and bytes, in the order given (an iterable's named by position).

    Args:
        tensors (`Mapping[str, torch.Tensor]` or `Iterable[torch.Tensor]`): Any dtypes, shapes and devices.
        digest_size (`int`, defaults to 32): Bytes kept of the digest, ``1`` to ``32``.

    Raises:
        ValueError: if ``digest_size`` is not in ``[1, 32]``.
    """
    if not 1 <= digest_size <= 32:
        raise ValueError(f"`digest_size` must be in [1, 32] (bytes of a SHA-256 digest), got {digest_size}.")
    items = tensors.items() if isinstance(tensors, Mapping) else ((str(i), t) for i, t in enumerate(tensors))
    digest = hashlib.sha256()
    for name, tensor in items:
        tensor = tensor.detach().cpu().contiguous()  # one tensor at a time on the CPU
        # the name, dtype and shape count, so equal bytes under another name differ
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.digest()[:digest_size]


def weights_fingerprint(model: nn.Module) -> str:
    """SHA-256 of ``model.state_dict()`` in name order (:func:`tensors_fingerprint`), as 64 hex characters.

    Raises:
        TypeError: if ``model`` has no ``state_dict`` method.
    """
    if not callable(getattr(model, "state_dict", None)):
        raise TypeError(f"`model` must be an nn.Module (with state_dict()), got {type(model).__name__}.")
    # result files record this value: its definition must not change
    return tensors_fingerprint(dict(sorted(model.state_dict().items()))).hex()
