"""hardway.text.sentencepiece through gguf_tokenizer: Gemma 3's SentencePiece BPE from its GGUF metadata, id for id
and text for text as transformers' tokenizer for the same file (saved once by tools/standins.py, read here with the
tokenizers package), built in seconds; and Gemma's built-in chat template for a file that carries none."""

import time

import numpy as np
import pytest
from tokenizers import Tokenizer

from hardway.formats.gguf import gemma3_gguf, read_gguf
from hardway.text.gguf_tokenizer import gguf_chat_template, gguf_tokenizer
from hardway.formats.hub import models_dir
from hardway.text.sentencepiece import SentencePieceTokenizer
from hardway import load_tokenizer  # the public one: a .gguf too


@pytest.fixture(scope="module")
def path():
    return gemma3_gguf(models_dir() / "gguf")


@pytest.fixture(scope="module")
def ours(path):
    return gguf_tokenizer(read_gguf(path))


@pytest.fixture(scope="module")
def reference():
    return Tokenizer.from_file(str(models_dir() / "reference" / "gemma-3-270m-tokenizer" / "tokenizer.json"))


def texts() -> dict[str, str]:
    shakespeare = (models_dir() / "data" / "shakespeare.txt").read_text(encoding="utf-8")
    return {
        "shakespeare": shakespeare[:30_000],
        "shakespeare, further in": shakespeare[400_000:430_000],
        "code": "import torch\n\nclass Net(torch.nn.Module):\n    def forward(self, x):  # (B, T, C)\n"
                "        return x.softmax(-1) @ self.w.T\n\tif a != b and c <= d: print(f'{a!r:>10}')\n",
        "unicode": "日本語の文章です。你好，世界！한국어 Ελληνικά русский עברית العربية हिन्दी "
                   "😀🎉👍🏽👩‍💻🇫🇷 café naïve Ünïcödé ñ ß Ω ≤ ∑ 𝔘𝔫𝔦 \U0002A6A5",
        "whitespace": "  two  spaces   three    four\t\ttabs \u00a0nbsp\u3000ideographic  ",
        "newlines": "a\nb\n\nc\n\n\n\nd\r\ne\r\n\r\nf\n \n",
        "control tokens": "<bos>x<eos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n<pad><unk><mask>",
        "user-defined tokens": "<table><tr><td>1</td></tr></table> <h1>T</h1> [multimodal]",
        "edges": " leading, trailing ",
        "empty": "",
        "one space": " ",
        "bytes the vocabulary lacks": "\x00\x01\x7f\ufffd\U000e0001 \U0001f9ec",
    }


@pytest.mark.parametrize("name", list(texts()))
def test_ids_and_text_are_transformers(ours, reference, name):
    text = texts()[name]
    ids = ours.encode(text)
    assert ids == reference.encode(text).ids
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=False)
    assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids


def test_the_shape_of_the_vocabulary(ours, reference):
    assert ours.vocab_size == reference.get_vocab_size() == 262_144
    assert ours.encode("Hello")[0] == 2  # <bos>: the file says add_bos_token
    assert ours.encode("<start_of_turn>", add_special_tokens=False) == [reference.token_to_id("<start_of_turn>")]
    assert ours.encode("😀", add_special_tokens=False) == reference.encode("😀", add_special_tokens=False).ids


def test_decoding_any_ids_is_transformers(ours, reference):
    import random

    g = random.Random(0)
    for _ in range(20):
        ids = [g.randrange(262_144) for _ in range(200)]
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=False)
    byte_ids = [reference.token_to_id(f"<0x{b:02X}>") for b in "é😀".encode()]
    assert ours.decode(byte_ids) == "é😀" and ours.decode(byte_ids[:1]) == "\ufffd"


def test_it_is_built_in_seconds(path):
    meta = read_gguf(path).metadata
    start = time.perf_counter()
    SentencePieceTokenizer(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"], 2)
    assert time.perf_counter() - start < 20  # about 2 s on an idle core; transformers takes about 25 s


def test_load_tokenizer_reads_it_from_the_gguf_alone(path, ours):
    assert not (path.parent / "tokenizer.json").exists()
    loaded = load_tokenizer(path)
    assert isinstance(loaded, SentencePieceTokenizer) and loaded.encode("To be, or not") == ours.encode("To be, or not")


def test_gemmas_built_in_chat_template(path, reference):
    chat = gguf_chat_template(path)
    assert "tokenizer.chat_template" not in read_gguf(path).metadata  # the base model's file carries none
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi there \n"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    by_hand = ("<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
               "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert chat.render(messages, add_generation_prompt=True) == by_hand
    assert chat.render(messages[1:2]) == "<bos><start_of_turn>user\nHi there<end_of_turn>\n"
    assert chat.encode(messages, add_generation_prompt=True) == reference.encode(by_hand, add_special_tokens=False).ids
    assert chat.end_of_turn_ids() == [reference.token_to_id("<end_of_turn>"), reference.token_to_id("<eos>")]
    with pytest.raises(ValueError, match="alternate"):
        chat.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_a_sentencepiece_vocabulary_with_a_space_prefix_is_refused(tmp_path):
    import gguf

    from hardway.formats.gguf import GGUFError

    path = tmp_path / "llama2.gguf"
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "▁a"])
    writer.add_token_types([2, 3, 3, 1])
    writer.add_tensor("x", np.zeros(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="puts a space before the text"):
        gguf_tokenizer(path)
