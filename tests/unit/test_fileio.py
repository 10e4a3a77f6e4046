"""The one sha256-of-a-file and the one atomic write, link or copy (scripts/sparkllm/fileio.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from sparkllm.fileio import (
    atomic_path,
    atomic_write,
    place_atomic,
    sha256_file,
    write_bytes_atomic,
    write_json_atomic,
)


def test_sha256_file_matches_hashlib_across_chunk_boundaries(tmp_path: Path) -> None:
    data = bytes(range(256)) * 1000 + b"tail"
    p = tmp_path / "blob"
    p.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    assert sha256_file(p) == want
    assert sha256_file(p, chunk=7) == want  # many short reads, one odd last block
    p.write_bytes(b"")
    assert sha256_file(p) == hashlib.sha256(b"").hexdigest()


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    dest = tmp_path / "out.json"
    dest.write_text("old")
    write_bytes_atomic(dest, b"new")
    assert dest.read_bytes() == b"new"
    write_json_atomic(dest, {"b": 1, "a": [1, 2]})
    assert dest.read_text() == '{\n  "b": 1,\n  "a": [\n    1,\n    2\n  ]\n}\n'
    assert json.loads(dest.read_text()) == {"b": 1, "a": [1, 2]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_atomic_write_failure_keeps_the_old_file(tmp_path: Path) -> None:
    dest = tmp_path / "model.safetensors"
    dest.write_bytes(b"complete")
    with pytest.raises(RuntimeError, match="refused"), atomic_write(dest, tag="incomplete") as f:
        f.write(b"half")
        f.flush()
        assert Path(f.name).name.startswith(".model.safetensors.incomplete-")
        assert Path(f.name).read_bytes() == b"half"  # the block can check what it wrote
        raise RuntimeError("refused")
    assert dest.read_bytes() == b"complete"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_atomic_write_creates_a_new_file(tmp_path: Path) -> None:
    dest = tmp_path / "fresh"
    with atomic_write(dest) as f:
        f.write(b"x" * 10)
        assert not dest.exists()  # nothing visible until the block ends
    assert dest.read_bytes() == b"x" * 10


def test_place_atomic_links_on_one_filesystem_and_copies_where_links_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "model_extra_tensors.safetensors"
    src.write_bytes(b"mtp" * 1000)
    out = tmp_path / "out"
    out.mkdir()
    (out / src.name).write_bytes(b"stale")
    assert place_atomic(src, out / src.name) is True
    assert (out / src.name).stat().st_ino == src.stat().st_ino  # the same file, hard-linked
    assert sorted(p.name for p in out.iterdir()) == [src.name]

    def no_link(a: object, b: object) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr("sparkllm.fileio.os.link", no_link)
    other = tmp_path / "other"
    other.mkdir()
    assert place_atomic(src, other / src.name) is False
    assert (other / src.name).read_bytes() == src.read_bytes()
    assert (other / src.name).stat().st_ino != src.stat().st_ino
    assert sorted(p.name for p in other.iterdir()) == [src.name]


def test_place_atomic_failure_leaves_the_destination_as_it_was(tmp_path: Path) -> None:
    dest = tmp_path / "kept"
    dest.write_bytes(b"complete")
    with pytest.raises(FileNotFoundError):
        place_atomic(tmp_path / "missing", dest)
    assert dest.read_bytes() == b"complete"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]


def test_atomic_path_gives_the_block_a_fresh_sibling(tmp_path: Path) -> None:
    dest = tmp_path / "part.safetensors"
    with atomic_path(dest, "part") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".part.safetensors.part-")
        assert not tmp.exists()
        tmp.write_bytes(b"shard")
        assert not dest.exists()
    assert dest.read_bytes() == b"shard"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part.safetensors"]
