"""A content hash of a model's weights: equal fingerprints mean bitwise-equal weights.

Defined in the leaf module :mod:`trl_es.fingerprint` (with :func:`~trl_es.fingerprint.tensors_fingerprint`, the
general form) and re-exported here.
"""

from __future__ import annotations

from ..fingerprint import weights_fingerprint


__all__ = ["weights_fingerprint"]
