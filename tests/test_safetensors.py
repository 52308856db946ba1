"""hardway.formats.safetensors against the safetensors library, and against files built by hand to be broken."""

import gc
import json
import os
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file as lib_load_file
from safetensors.torch import save_file

from hardway.formats.hub import models_dir
from hardway.formats.safetensors import DTYPES, SafetensorsError, load_checkpoint, load_file, read_header

SHAPES = [(), (0,), (3, 0, 2), (7,), (2, 3, 5)]


def sample(dtype, shape, seed=0):
    """Random values covering the dtype's range (specials included for floats)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=gen, dtype=torch.float64) * 1000).to(dtype)
        specials = torch.tensor([float("inf"), float("-inf"), -0.0, float("nan")], dtype=dtype)
        flat = t.reshape(-1)
        flat[: min(4, flat.numel())] = specials[: min(4, flat.numel())]
        return t
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=dtype, generator=gen)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (so NaN == NaN and -0.0 != 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def write_raw(path, header, data=b"", header_size=None):
    """A file built by hand: 8-byte size, header bytes (JSON-encoded unless bytes), data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if header_size is None else header_size
    path.write_bytes(n.to_bytes(8, "little") + raw + data)
    return path


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


# ---------------------------------------------------------------- equality with the safetensors library


@pytest.mark.parametrize("name", list(DTYPES))
def test_every_dtype_and_shape_equals_the_safetensors_library(tmp_path, name):
    dtype = DTYPES[name]
    tensors = {f"t{i}": sample(dtype, shape, seed=i) for i, shape in enumerate(SHAPES)}
    path = tmp_path / f"{name}.safetensors"
    save_file(tensors, path)
    ours, theirs = load_file(path), lib_load_file(path)
    assert ours.keys() == theirs.keys() == tensors.keys()
    for key in tensors:
        assert same(ours[key], theirs[key]), key
        assert same(ours[key], tensors[key]), key
    assert {k: read_header(path)[k]["dtype"] for k in tensors} == {k: name for k in tensors}


def test_mixed_dtypes_in_one_file_with_metadata(tmp_path):
    tensors = {name: sample(dtype, (3, 4), seed=i) for i, (name, dtype) in enumerate(DTYPES.items())}
    path = tmp_path / "mixed.safetensors"
    save_file(tensors, path, metadata={"format": "pt", "note": "hello"})
    ours, theirs = load_file(path), lib_load_file(path)
    assert ours.keys() == theirs.keys() and all(same(ours[k], theirs[k]) for k in theirs)
    header = read_header(path)
    with safe_open(path, framework="pt") as f:
        assert header["__metadata__"] == f.metadata() == {"format": "pt", "note": "hello"}
        assert set(header) - {"__metadata__"} == set(f.keys())


def test_real_bf16_checkpoint_equals_the_safetensors_library():
    path = models_dir() / "HuggingFaceTB/SmolLM2-135M-Instruct/model.safetensors"
    ours, theirs = load_file(path), lib_load_file(path)
    assert ours.keys() == theirs.keys() and len(theirs) > 100
    assert {t.dtype for t in theirs.values()} == {torch.bfloat16}
    assert all(same(ours[k], theirs[k]) for k in theirs)


# ---------------------------------------------------------------- memory mapping: valid, writable, file untouched


def test_tensors_are_writable_and_writes_never_reach_the_file(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.int64)}, path)
    before = path.read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on a non-writable buffer: there must be none
        tensors = load_file(path)
    tensors["a"] += 10
    tensors["b"][0] = -5
    assert tensors["a"][1, 2].item() == 15.0 and tensors["b"].tolist() == [-5, 1, 1, 1]
    assert path.read_bytes() == before
    assert torch.equal(load_file(path)["a"], torch.arange(6, dtype=torch.float32).reshape(2, 3))


def test_tensors_stay_valid_after_the_file_is_closed_and_replaced(tmp_path):
    path = tmp_path / "v.safetensors"
    original = sample(torch.float32, (64, 64))
    save_file({"a": original}, path)
    tensors = load_file(path)
    gc.collect()
    # Replacing the file the safe way (new file, then os.replace) leaves our mapping on the old contents.
    save_file({"a": torch.zeros(64, 64)}, tmp_path / "new.safetensors")
    os.replace(tmp_path / "new.safetensors", path)
    gc.collect()
    assert same(tensors["a"], original)
    assert torch.equal(load_file(path)["a"], torch.zeros(64, 64))


def test_views_share_one_mapping_instead_of_copying(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(1000), "b": torch.zeros(1000)}, path)
    tensors = load_file(path)
    data_start = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    # Both tensors point into the same mapped region, at their offsets: nothing was cloned.
    gap = tensors["b"].data_ptr() - tensors["a"].data_ptr()
    offsets = read_header(path)
    assert gap == offsets["b"]["data_offsets"][0] - offsets["a"]["data_offsets"][0]
    assert data_start > 8


# ---------------------------------------------------------------- bad input: one clear SafetensorsError each


def test_safetensors_error_is_a_value_error():
    assert issubclass(SafetensorsError, ValueError)


@pytest.mark.parametrize("size", [0, 1, 7])
def test_file_shorter_than_8_bytes(tmp_path, size):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x01" * size)
    with pytest.raises(SafetensorsError, match="shorter than the 8-byte header size"):
        read_header(path)
    with pytest.raises(SafetensorsError, match="shorter than the 8-byte header size"):
        load_file(path)


@pytest.mark.parametrize("claimed", [100, 2**40, 2**64 - 1])
def test_header_size_beyond_the_file_is_not_believed(tmp_path, claimed):
    path = write_raw(tmp_path / "big.safetensors", {"a": entry()}, bytes(8), header_size=claimed)
    with pytest.raises(SafetensorsError, match=f"header size {claimed} runs past the end of the"):
        load_file(path)


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"\xff\xfe{}", "not UTF-8"),
        (b"{not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),  # nesting deep enough to blow the recursion limit
        (b'{"a": ' + b"9" * 5000 + b"}", "not valid JSON"),  # an integer too long to convert
        (b"[]", "header is a JSON list, not a JSON object"),
        (b'"x"', "header is a JSON str, not a JSON object"),
    ],
)
def test_header_that_is_not_a_utf8_json_object(tmp_path, raw, match):
    path = write_raw(tmp_path / "h.safetensors", raw)
    with pytest.raises(SafetensorsError, match=match):
        load_file(path)


@pytest.mark.parametrize(
    "header, match",
    [
        ({"a": 1}, "tensor 'a' must be an object with dtype, shape and data_offsets"),
        ({"a": {"dtype": "F32", "shape": [2]}}, "must be an object with dtype, shape and data_offsets"),
        ({"a": entry(dtype="Q4")}, "tensor 'a' has unknown dtype 'Q4'"),
        ({"a": entry(dtype="F8_E4M3", offsets=(0, 2))}, "unknown dtype 'F8_E4M3'"),
        ({"a": entry(dtype=4)}, "unknown dtype 4"),
        ({"a": {**entry(), "shape": [-2]}}, "tensor 'a' has bad shape"),
        ({"a": {**entry(), "shape": [2.0]}}, "has bad shape"),
        ({"a": {**entry(), "shape": [True, 2]}}, "has bad shape"),
        ({"a": {**entry(), "shape": "2"}}, "has bad shape"),
        ({"a": {**entry(), "data_offsets": [8, 0]}}, "bad data_offsets"),
        ({"a": {**entry(), "data_offsets": [0]}}, "bad data_offsets"),
        ({"a": {**entry(), "data_offsets": [-8, 0]}}, "bad data_offsets"),
        ({"a": {**entry(), "data_offsets": ["0", 8]}}, "bad data_offsets"),
        ({"a": entry(offsets=(0, 16))}, r"data_offsets \[0, 16\] run past the 8 bytes of data"),
        ({"a": entry(offsets=(8, 16))}, "run past the 8 bytes of data"),
        ({"a": entry(shape=(3,))}, r"hold 8 bytes, but shape \[3\] × F32 \(4 bytes each\) needs 12"),
        ({"a": entry(dtype="F64")}, "needs 16"),
        ({"a": entry(shape=(2**40, 2**40, 2**40))}, "needs over 2\\*\\*64"),  # no giant allocation, no giant integer
        ({"a": entry(shape=(1,), offsets=(0, 4)), "b": entry(shape=(1,), offsets=(2, 6))}, "tensors 'a' .* and 'b' .* overlap"),
        ({"a": entry(), "b": entry()}, "overlap"),
        ({"__metadata__": {"k": 1}, "a": entry()}, "__metadata__ must be an object of strings"),
        ({"__metadata__": ["x"], "a": entry()}, "__metadata__ must be an object of strings"),
    ],
)
def test_bad_tensor_entries(tmp_path, header, match):
    path = write_raw(tmp_path / "e.safetensors", header, bytes(8))
    with pytest.raises(SafetensorsError, match=match):
        read_header(path)
    with pytest.raises(SafetensorsError, match=match):
        load_file(path)


def test_hand_built_file_with_zero_length_and_adjacent_tensors_loads(tmp_path):
    # The counterpart of the failures above: a valid hand-built file (empty tensors take no bytes, no gaps).
    header = {
        "a": entry("I16", (2,), (0, 4)),
        "empty": entry("F32", (0, 5), (4, 4)),
        "b": entry("U8", (), (4, 5)),
        "c": entry("BOOL", (2,), (5, 7)),
    }
    path = write_raw(tmp_path / "ok.safetensors", header, bytes([1, 0, 255, 255, 7, 1, 0]))
    assert lib_load_file(path).keys() == header.keys()  # the library accepts it too
    tensors = load_file(path)
    assert tensors["a"].tolist() == [1, -1]
    assert tensors["empty"].shape == (0, 5) and tensors["empty"].dtype == torch.float32
    assert tensors["b"].shape == () and tensors["b"].item() == 7
    assert tensors["c"].tolist() == [True, False]


A = '"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}'


@pytest.mark.parametrize(
    "raw, data, match",
    [
        # A repeated key: json.loads would silently keep the last one.
        ("{" + A + ", " + A.replace("[0, 2]", "[1, 3]") + "}", b"xyz", "key 'a' appears twice"),
        ('{"a": {"dtype": "U8", "dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}', b"xy", "key 'dtype' appears twice"),
        ('{"__metadata__": {}, "__metadata__": {"k": "v"}, ' + A + "}", b"xy", "key '__metadata__' appears twice"),
        # Bytes that belong to no tensor: after the last one, between two, before the first.
        ("{" + A + "}", b"xyz", "1 bytes after the last tensor"),
        ("{" + A + "}", bytes(1000), "998 bytes after the last tensor"),
        ('{"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "b": {"dtype": "U8", "shape": [1], "data_offsets": [3, 4]}}',
         b"wxyz", "1 unused bytes after 'a', before tensor 'b'"),
        ('{"a": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}', b"xyz", "1 unused bytes at the start of the data, before tensor 'a'"),
        # An empty tensor placed inside another one's bytes.
        ("{" + A + ', "e": {"dtype": "U8", "shape": [0], "data_offsets": [1, 1]}}', b"xy", "tensors 'a' .* and 'e' .* overlap"),
    ],
)
def test_files_the_library_rejects_we_reject(tmp_path, raw, data, match):
    path = write_raw(tmp_path / "strict.safetensors", raw.encode(), data)
    with pytest.raises(SafetensorsError, match=match):
        load_file(path)
    with pytest.raises(Exception, match="duplicate field|not fully covered|invalid offset"):  # the reference agrees
        lib_load_file(path)


@pytest.mark.parametrize("raw", [
    "{" + A + ", " + A + "}",  # the same entry, word for word, twice
    '{"__metadata__": {"k": "1", "k": "2"}, ' + A + "}",  # a repeated key inside __metadata__
])
def test_repeated_keys_the_library_lets_through_are_refused_here(tmp_path, raw):
    # Lesson 01 says so: these cannot change what the library loads, and it accepts them; we refuse every repeat.
    path = write_raw(tmp_path / "repeat.safetensors", raw.encode(), b"xy")
    assert lib_load_file(path).keys() == {"a"}
    with pytest.raises(SafetensorsError, match="appears twice"):
        load_file(path)


def test_a_file_appended_to_is_refused(tmp_path):
    # What two downloads writing one file used to produce: a valid file with more bytes after it.
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4, 4)}, path)
    load_file(path)
    with open(path, "ab") as f:
        f.write(bytes(256 * 1024))
    with pytest.raises(SafetensorsError, match="262144 bytes after the last tensor"):
        load_file(path)


def test_missing_file_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_file(tmp_path / "nope.safetensors")


# ---------------------------------------------------------------- checkpoints: single file and sharded


def write_sharded(folder, tensors, n_shards=3):
    names = sorted(tensors)
    weight_map = {name: f"model-{1 + i % n_shards:05d}-of-{n_shards:05d}.safetensors" for i, name in enumerate(names)}
    for shard in set(weight_map.values()):
        save_file({n: tensors[n] for n in names if weight_map[n] == shard}, folder / shard)
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return weight_map


def checkpoint_tensors():
    return {f"layers.{i}.{kind}": sample(dtype, (4, 3), seed=i) for i, (kind, dtype) in enumerate(
        [("w", torch.float32), ("b", torch.bfloat16), ("m", torch.bool), ("i", torch.int64), ("h", torch.float16)])}


def test_load_checkpoint_single_file(tmp_path):
    tensors = checkpoint_tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    loaded = load_checkpoint(tmp_path)
    assert loaded.keys() == tensors.keys() and all(same(loaded[k], tensors[k]) for k in tensors)


def test_sharded_checkpoint_round_trip(tmp_path):
    tensors = checkpoint_tensors()
    weight_map = write_sharded(tmp_path, tensors)
    assert len(set(weight_map.values())) == 3
    loaded = load_checkpoint(tmp_path)
    assert loaded.keys() == tensors.keys() and all(same(loaded[k], tensors[k]) for k in tensors)


def test_sharded_checkpoint_with_a_missing_shard(tmp_path):
    weight_map = write_sharded(tmp_path, checkpoint_tensors())
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(SafetensorsError, match="shard model-00002-of-00003.safetensors .* is missing"):
        load_checkpoint(tmp_path)
    assert "model-00002-of-00003.safetensors" in weight_map.values()


def test_index_naming_a_tensor_its_shard_lacks(tmp_path):
    weight_map = write_sharded(tmp_path, checkpoint_tensors())
    weight_map["layers.9.ghost"] = "model-00001-of-00003.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(SafetensorsError, match="not in their shards, e.g. 'layers.9.ghost'"):
        load_checkpoint(tmp_path)


def test_shard_holding_a_tensor_the_index_puts_elsewhere(tmp_path):
    weight_map = write_sharded(tmp_path, checkpoint_tensors())
    del weight_map["layers.0.w"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(SafetensorsError, match="holds 'layers.0.w', which the index assigns to None"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors", ".."])
def test_shard_names_cannot_leave_the_folder(tmp_path, shard):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shard}}))
    with pytest.raises(SafetensorsError, match="is not a plain file name"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("text", ["{", "[]", '{"metadata": {}}', '{"weight_map": {"a": 3}}', '{"weight_map": []}'])
def test_bad_index(tmp_path, text):
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(SafetensorsError, match="model.safetensors.index.json"):
        load_checkpoint(tmp_path)


def test_folder_without_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_checkpoint(tmp_path)
