"""A content hash of a model's weights (:func:`trl_es.fingerprint.weights_fingerprint`, re-exported)."""

from __future__ import annotations

from ..fingerprint import weights_fingerprint


__all__ = ["weights_fingerprint"]
