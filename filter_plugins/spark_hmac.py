"""The serve stage's configuration hash: an HMAC, so that a world-readable copy reveals no secret.

Pure Python (standard library only); Ansible only needs the ``FilterModule`` at the bottom.

The hash covers the selected unit, its argument file and the secret files it reads (their sha256
checksums). A plain hash of those would land in the 0644 fact ``spark_serve.fact`` and in every
benchmark run's metadata, where a weak API key could be found offline by trying candidates. Keyed
with a random per-host key kept root-only (``<serve_config_dir>/config-hash.key``, 0600), the value
still changes whenever any input changes but cannot be recomputed without that key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence


def spark_config_hmac(checksums: Sequence[str], key: str) -> str:
    """HMAC-SHA256 (hex) of the checksums, joined by newlines, under ``key``."""
    if not isinstance(key, str) or len(key) < 16:
        raise ValueError("the configuration hash key is missing or shorter than 16 characters; remove "
                         "<serve_config_dir>/config-hash.key on the Spark and rerun the serve stage "
                         "to create a new one")
    if isinstance(checksums, str) or not all(isinstance(c, str) for c in checksums):
        raise ValueError(f"checksums must be a list of strings, got {checksums!r}")
    message = "\n".join(checksums).encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


class FilterModule:
    """Ansible filter: spark_config_hmac."""

    def filters(self):
        return {"spark_config_hmac": spark_config_hmac}
