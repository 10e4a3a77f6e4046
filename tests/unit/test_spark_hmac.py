"""Unit tests for filter_plugins/spark_hmac.py: the serve configuration hash reveals no secret."""

from __future__ import annotations

import hashlib

import pytest
from spark_hmac import FilterModule, spark_config_hmac

KEY = "k" * 32
SUMS = ["a" * 64, "b" * 64, "c" * 64]


def test_changes_with_any_input_and_with_the_key():
    base = spark_config_hmac(SUMS, KEY)
    assert len(base) == 64 and base == spark_config_hmac(list(SUMS), KEY)
    assert spark_config_hmac(SUMS[:2] + ["d" * 64], KEY) != base
    assert spark_config_hmac(SUMS, "j" * 32) != base


def test_is_not_a_plain_hash_of_the_inputs():
    """Without the key, nobody can recompute it from candidate secrets (the old hash was plain sha256)."""
    joined = "\n".join(SUMS)
    assert spark_config_hmac(SUMS, KEY) not in {hashlib.sha256(joined.encode()).hexdigest(),
                                                hashlib.sha256(":".join(SUMS).encode()).hexdigest()}


@pytest.mark.parametrize("key", ["", None, "short"])
def test_missing_key_names_the_fix(key):
    with pytest.raises(ValueError, match="config-hash.key"):
        spark_config_hmac(SUMS, key)


def test_checksums_must_be_a_list_of_strings():
    with pytest.raises(ValueError, match="list of strings"):
        spark_config_hmac("abc", KEY)


def test_filter_registered():
    assert FilterModule().filters()["spark_config_hmac"] is spark_config_hmac
