"""Content hashes of tensors: equal fingerprints mean bitwise-equal tensors (up to SHA-256 collisions).

A leaf module (``hashlib`` and ``torch`` only), so that any room can use it: the recipes record
:func:`weights_fingerprint` (re-exported by :mod:`trl_es.analysis`), and a check that several processes hold the same
weights can all-gather a short :func:`tensors_fingerprint`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch
from torch import nn


__all__ = ["tensors_fingerprint", "weights_fingerprint"]


def tensors_fingerprint(tensors: Mapping[str, torch.Tensor] | Iterable[torch.Tensor], digest_size: int = 32) -> bytes:
    """SHA-256 of the tensors, in the order given.

    Each tensor contributes its name, dtype, shape and raw bytes (copied to the CPU one at a time), so two sequences
    have the same fingerprint exactly when they hold the same tensors bitwise under the same names (up to SHA-256
    collisions). A tensor given without a name (``tensors`` an iterable, not a mapping) is named by its position.

    Args:
        tensors (`Mapping[str, torch.Tensor]` or `Iterable[torch.Tensor]`): Any dtypes, shapes and devices.
        digest_size (`int`, defaults to 32): Bytes kept of the SHA-256 digest (its first ones), ``1`` to ``32``.

    Returns:
        `bytes`: ``digest_size`` bytes.

    Raises:
        ValueError: if ``digest_size`` is not in ``[1, 32]``.
    """
    if not 1 <= digest_size <= 32:
        raise ValueError(f"`digest_size` must be in [1, 32] (bytes of a SHA-256 digest), got {digest_size}.")
    items = tensors.items() if isinstance(tensors, Mapping) else ((str(i), t) for i, t in enumerate(tensors))
    digest = hashlib.sha256()
    for name, tensor in items:
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.digest()[:digest_size]


def weights_fingerprint(model: nn.Module) -> str:
    """SHA-256 of every tensor of ``model.state_dict()``, in name order (:func:`tensors_fingerprint`), as hex.

    Two models have the same fingerprint exactly when they hold the same tensors bitwise (up to SHA-256 collisions).
    Used to show that a phase starts from the previous phase's exact weights, or that a replay from the seed log
    reproduces the trained model. The value is recorded in result files, so its definition does not change.

    Args:
        model: any ``nn.Module``; parameters and buffers of every dtype count.

    Returns:
        The 64-character hexadecimal digest.

    Raises:
        TypeError: if ``model`` has no ``state_dict`` method.
    """
    if not callable(getattr(model, "state_dict", None)):
        raise TypeError(f"`model` must be an nn.Module (with state_dict()), got {type(model).__name__}.")
    return tensors_fingerprint(dict(sorted(model.state_dict().items()))).hex()
