"""A content hash of a model's weights: equal fingerprints mean bitwise-equal weights."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

__all__ = ["weights_fingerprint"]


def weights_fingerprint(model: nn.Module) -> str:
    """SHA-256 of every tensor of ``model.state_dict()``, in name order.

    Each tensor contributes its name, dtype, shape and raw bytes (copied to the CPU), so two models have the same
    fingerprint exactly when they hold the same tensors bitwise (up to SHA-256 collisions). Used to show that a phase
    starts from the previous phase's exact weights, or that a replay from the seed log reproduces the trained model.

    Args:
        model: any ``nn.Module``; parameters and buffers of every dtype count.

    Returns:
        The 64-character hexadecimal digest.

    Raises:
        TypeError: if ``model`` has no ``state_dict`` method.
    """
    if not callable(getattr(model, "state_dict", None)):
        raise TypeError(f"`model` must be an nn.Module (with state_dict()), got {type(model).__name__}.")
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
