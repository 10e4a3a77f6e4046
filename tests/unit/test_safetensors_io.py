"""safetensors_io: header parsing/validation, writing, range copies, index helpers."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from sparkllm.checkpoint import safetensors_io as sio
from sparkllm.checkpoint.safetensors_io import ByteRange, SafetensorsError, TensorSpec
from sparkllm.fileio import write_json_atomic

from tests.fixtures.make_checkpoints import GenConfig, generate


def write_file(path: Path, specs: list[TensorSpec], payload: bytes | None = None) -> bytes:
    data = payload if payload is not None else os.urandom(sum(s.nbytes for s in specs))
    path.write_bytes(sio.encode_header(specs, {"format": "pt"}) + data)
    return data


def raw_file(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_roundtrip_readable_by_safetensors_library(tmp_path: Path) -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    specs = [TensorSpec("a", "F32", (3, 4)), TensorSpec("b", "I32", (2,)), TensorSpec("c", "F8_E4M3", (5,))]
    f = tmp_path / "x.safetensors"
    write_file(f, specs, arr.tobytes() + np.array([7, 8], dtype=np.int32).tobytes() + b"\x01" * 5)
    h = sio.read_header(f)
    assert h.header_len % 8 == 0
    assert [t.name for t in h.tensors.values()] == ["a", "b", "c"]
    assert h.tensors["c"].nbytes == 5 and h.file_size == f.stat().st_size
    with safe_open(str(f), framework="numpy") as s:
        np.testing.assert_array_equal(s.get_tensor("a"), arr)
        assert s.get_tensor("b").tolist() == [7, 8]
        assert s.metadata() == {"format": "pt"}


@pytest.mark.parametrize(
    ("header", "data", "problem"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "truncated"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 9, "trailing bytes"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "gap"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            "overlap",
        ),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "numel*itemsize"),
        ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2, "unknown dtype"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "bad shape"),
    ],
)
def test_invalid_headers_name_file_and_problem(
    tmp_path: Path, header: dict, data: bytes, problem: str
) -> None:
    f = tmp_path / "bad.safetensors"
    raw_file(f, header, data)
    with pytest.raises(SafetensorsError) as exc:
        sio.read_header(f)
    assert str(f) in str(exc.value) and problem in str(exc.value)


def test_header_length_bounds(tmp_path: Path) -> None:
    f = tmp_path / "huge.safetensors"
    f.write_bytes(struct.pack("<Q", sio.MAX_HEADER_BYTES + 1) + b"{}")
    with pytest.raises(SafetensorsError, match="exceeds"):
        sio.read_header(f)
    f.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(SafetensorsError, match="past the end"):
        sio.read_header(f)
    f.write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsError, match="too short"):
        sio.read_header(f)
    f.write_bytes(struct.pack("<Q", 4) + b"nope")
    with pytest.raises(SafetensorsError, match="not valid UTF-8 JSON"):
        sio.read_header(f)


def test_dtype_sizes() -> None:
    assert sio.dtype_size("F8_E4M3") == 1 and sio.dtype_size("BF16") == 2 and sio.dtype_size("I64") == 8
    with pytest.raises(ValueError, match="unknown"):
        sio.dtype_size("F4")


def test_encode_header_rejects_duplicates() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        sio.encode_header([TensorSpec("a", "U8", (1,)), TensorSpec("a", "U8", (1,))])


def test_coalesce_only_merges_touching_neighbours() -> None:
    rs = [
        ByteRange(0, 4),
        ByteRange(4, 4),
        ByteRange(10, 2),
        ByteRange(12, 0),
        ByteRange(12, 3),
        ByteRange(0, 1),
    ]
    assert sio.coalesce(rs) == [ByteRange(0, 8), ByteRange(10, 5), ByteRange(0, 1)]


@pytest.mark.parametrize("fallback", ["none", "sendfile", "plain"])
def test_copy_ranges_and_fallbacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fallback: str) -> None:
    src = tmp_path / "src"
    data = os.urandom(5000)
    src.write_bytes(data)

    def broken(*a: object, **k: object) -> int:
        raise OSError(38, "not supported")

    if fallback in ("sendfile", "plain"):
        monkeypatch.setattr(os, "copy_file_range", broken)
    if fallback == "plain":
        monkeypatch.setattr(os, "sendfile", broken)
    dst = tmp_path / "dst"
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        fo.write(b"HDR")
        fo.flush()
        n = sio.copy_ranges(
            fi.fileno(), fo.fileno(), [ByteRange(10, 100), ByteRange(110, 50), ByteRange(4000, 1000)]
        )
    assert n == 1150
    assert dst.read_bytes() == b"HDR" + data[10:160] + data[4000:5000]


def test_copy_range_past_eof_raises(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"abc")
    with open(src, "rb") as fi, open(tmp_path / "dst", "wb") as fo, pytest.raises(OSError):
        sio.copy_range(fi.fileno(), fo.fileno(), 0, 10)


def test_index_build_and_read(tmp_path: Path) -> None:
    write_file(tmp_path / "a.safetensors", [TensorSpec("x", "BF16", (4,)), TensorSpec("y", "F32", (2,))])
    write_file(tmp_path / "b.safetensors", [TensorSpec("z", "U8", (3,))])
    headers = {n: sio.read_header(tmp_path / n) for n in ("a.safetensors", "b.safetensors")}
    doc = sio.build_index(headers)
    assert doc["metadata"]["total_size"] == 8 + 8 + 3
    assert doc["weight_map"] == {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}
    write_json_atomic(tmp_path / sio.INDEX_NAME, doc)
    idx = sio.read_index(tmp_path / sio.INDEX_NAME)
    assert idx.files == ["a.safetensors", "b.safetensors"] and idx.total_size == 19
    write_file(tmp_path / "c.safetensors", [TensorSpec("z", "U8", (3,))])
    headers["c.safetensors"] = sio.read_header(tmp_path / "c.safetensors")
    with pytest.raises(SafetensorsError, match="also in"):
        sio.build_index(headers)


def test_read_index_errors(tmp_path: Path) -> None:
    p = tmp_path / sio.INDEX_NAME
    p.write_text("{")
    with pytest.raises(SafetensorsError, match="not valid JSON"):
        sio.read_index(p)
    p.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(SafetensorsError, match="weight_map"):
        sio.read_index(p)


def test_generated_checkpoints_match_safetensors_library(tmp_path: Path) -> None:
    pair = generate(tmp_path, GenConfig(layers=4, experts=4))
    files = sorted(pair.int4_dir.glob("*.safetensors")) + sorted(pair.fp8_dir.glob("*.safetensors"))
    assert len(files) == 6
    for f in files:
        h = sio.read_header(f)
        with safe_open(str(f), framework="numpy") as s:
            assert set(s.keys()) == set(h.tensors)
            for name, info in h.tensors.items():
                sl = s.get_slice(name)
                assert sl.get_dtype() == info.dtype and tuple(sl.get_shape()) == info.shape
                if info.dtype in ("F32", "I32", "F16"):
                    assert s.get_tensor(name).nbytes == info.nbytes
    names = set(sio.read_header(pair.int4_dir / "model_extra_tensors.safetensors").tensors)
    assert names == set(pair.mtp_names) and all(n.startswith("mtp.") for n in names)
    assert len(names) == 17 + 3 * 4  # 785 with 256 experts
