"""Lesson 02: BPETokenizer reads a byte-level BPE tokenizer.json (Llama 3.2, SmolLM2) and encodes/decodes id for id
like tokenizers' Tokenizer.from_file (the reference, used here only to compare)."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from hardway.text.bpe import CACHE_MAX_CHARS, BPETokenizer, split_isolated
from hardway.formats.hub import checkpoint, shakespeare_path
from test_bpe import ANY_CHARACTER, NEWER  # the same characters as the BPE tests

REPOS = ["meta-llama/Llama-3.2-tokenizer", "HuggingFaceTB/SmolLM2-135M-Instruct"]
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def tokenizer_json(repo):
    return checkpoint(repo) / "tokenizer.json"


@pytest.fixture(scope="module", params=REPOS)
def pair(request):
    """(ours, theirs) for one tokenizer.json."""
    path = tokenizer_json(request.param)
    return BPETokenizer.from_tokenizer_json(path), Tokenizer.from_file(str(path))


@pytest.fixture(scope="module")
def book():
    return shakespeare_path().read_text(encoding="utf-8")


def write_variant(tmp_path, repo, change) -> str:
    """A copy of a tokenizer.json with `change(spec)` applied; returns its path."""
    spec = json.loads(tokenizer_json(repo).read_text(encoding="utf-8"))
    change(spec)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return str(path)


def test_known_ids():
    llama = BPETokenizer.from_tokenizer_json(tokenizer_json(REPOS[0]))
    # 128,000 BPE tokens + 257 added ones (the last, <|image|> = 128256, is beyond the model's 128,256 embeddings)
    assert llama.vocab_size == Tokenizer.from_file(str(tokenizer_json(REPOS[0]))).get_vocab_size() == 128_257
    assert llama.encode("") == [128000]  # the post-processor's <|begin_of_text|>, even for empty text
    assert llama.encode("", add_special_tokens=False) == []
    smol = BPETokenizer.from_tokenizer_json(tokenizer_json(REPOS[1]))
    assert smol.vocab_size == Tokenizer.from_file(str(tokenizer_json(REPOS[1]))).get_vocab_size() == 49_152
    user = json.loads(tokenizer_json(REPOS[1]).read_text(encoding="utf-8"))["model"]["vocab"]["user"]
    assert smol.encode("<|im_start|>user") == [1, user]  # added token 1, then the vocabulary's "user"
    assert smol.decode([1]) == "<|im_start|>"


def test_book_slice_ids_equal_tokenizers(pair, book):
    ours, theirs = pair
    text = book[:200_000]
    whole = ours.encode(text)
    assert whole == theirs.encode(text).ids
    assert len(whole) > 50_000
    begin = "<|begin_of_text|>" if ours.before else ""  # what Llama's post-processor put in front
    assert ours.decode(whole) == theirs.decode(whole, skip_special_tokens=False) == begin + text
    # Line by line: many starts of text (and many <|begin_of_text|> for Llama).
    lines = text.split("\n")
    ours_lines = [ours.encode(line) for line in lines]
    assert ours_lines == [e.ids for e in theirs.encode_batch(lines)]
    assert sum(map(len, ours_lines)) > 50_000


EDGE_CASES = [
    "", " ", "   ", "\t", "a  b", "a   b", "a \t\t b", "\t\tindented", "trailing   ", "trailing\t", "trailing\n\n",
    "\n", "\r\n", "x\r\n\r\ny", "line one\r\nline two\r\n", "  leading", "a\n \nb", " \n ", "\u000b\u000c\x1c\x85",
    "he's it't we're you've I'm they'll she'd", "SHE'S 'S 'Tis I'M O'NEILL THEY'LL WE'RE YOU'VE HE'D 'ſ 'K",
    "'s's'", "'", "''", "don't's", "(word [x] \"quoted\" \tword",
    "1234567890 3.14159 1,000,000 12 123 1234", "٣٤٥٦٧ ½ ²³ Ⅻ", "😀", "👍🏽 👨\u200d👩\u200d👧 🇫🇷", "日本語のテキスト 中文 한국어",
    "e\u0301 cafe\u0301 n\u0303", "\u0301alone", "non\u00a0breaking\u3000space\u2009thin", "zero\u200bwidth",
    "<|begin_of_text|>", "a<|begin_of_text|>b", "<|im_start|>user\nHi<|im_end|>\n", "<|endoftext|><|endoftext|>",
    "<|eot_id|><|start_header_id|>x", "<|im_start", "<<|im_end|>>", "\x00\x01\x04\x13\x7f", "!\x04!", "\ufeffBOM",
    "Ω≈ç√∫", "ﬁ ligature", "x" * 300, " " * 100 + "y",
]


@pytest.mark.parametrize("text", EDGE_CASES)
def test_edge_cases_equal_tokenizers(pair, text):
    ours, theirs = pair
    ids = ours.encode(text)
    assert ids == theirs.encode(text).ids
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False).ids
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=("Cs",))))
def test_round_trip_any_text(pair, text):
    ours, _ = pair
    if any(bytes([b]) not in ours.encoder for b in text.encode("utf-8")):
        return  # SmolLM2 has no token for some bytes (e.g. 0x04): tokenizers and we drop them (test_dropped_bytes)
    assert ours.decode(ours.encode(text, add_special_tokens=False)) == text


def test_dropped_bytes(pair):
    ours, theirs = pair
    text = "a\x04b"
    if bytes([4]) in ours.encoder:  # Llama 3: every byte has a token
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
    else:  # SmolLM2: 0x04 has no token and no unk_token: dropped, as by tokenizers
        assert ours.encode(text) == theirs.encode(text).ids == ours.encode("a") + ours.encode("b")  # 3 pieces
        # Inside one piece the byte is dropped before merging, so its neighbours can merge.
        assert ours.encode("!\x04!") == theirs.encode("!\x04!").ids == ours.encode("!!")


# ANY_CHARACTER: any character but the surrogates; NEWER: code points newer than Unicode 16.0, letters for `regex`
# and unassigned for tokenizers (test_bpe checks every one).
NEWER_AMONG_OTHERS = st.text(alphabet=st.sampled_from(NEWER + list("aZ+N1٣ .'sS\r\n\t\u00e9\u0301日😀(")), max_size=30)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=ANY_CHARACTER))
def test_random_text_ids_equal_tokenizers(pair, text):
    ours, theirs = pair
    assert ours.encode(text) == theirs.encode(text).ids


@settings(max_examples=300, deadline=None)
@given(NEWER_AMONG_OTHERS)
def test_newer_code_points_ids_equal_tokenizers(pair, text):
    ours, theirs = pair
    assert ours.encode(text) == theirs.encode(text).ids


def test_unassigned_code_point_before_punctuation(pair):
    # Found by the random test: U+3F21A is a letter for `regex` (newer Unicode), unassigned for tokenizers, so
    # Llama 3's regex took "+N" as one piece (72822) where tokenizers has "+" (10) and "N" (45).
    ours, theirs = pair
    text = "\U0003f21a+N"
    assert ours.encode(text) == theirs.encode(text).ids
    assert ours.pre_tokenize(text) == [text[a:b] for _, (a, b) in theirs.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("alphabet", [(ord("a"), ord("z")), (0x4E00, 0x9FFF)], ids=["a-z", "CJK"])
def test_100k_character_word_equals_tokenizers(pair, alphabet):
    # Not timed (benchmarks/tokenizer.py times it); the quadratic loop took over 60 s with Llama 3: now seconds.
    rng = random.Random(0)
    word = "".join(chr(rng.randint(*alphabet)) for _ in range(100_000))
    ours, theirs = pair
    assert ours.encode(word) == theirs.encode(word).ids
    assert not any(len(piece) > CACHE_MAX_CHARS for piece in ours.cache)  # long pieces are never kept


# Characters where Llama 3's regex is subtle: case-insensitive contractions, line breaks, digits, leading non-letters,
# and pieces of special tokens.
TRICKY = st.lists(st.sampled_from(list(" \t\n\r\u000b\u00a0'sSTtDdlLmMrRvVeE0123456789١(😀日\u0301-.<|>_")
                                  + ["<|im_start|>", "<|begin_of_text|>", "<|eot_id|>"]), max_size=40).map("".join)


@settings(max_examples=300, deadline=None)
@given(TRICKY)
def test_tricky_text_ids_equal_tokenizers(pair, text):
    ours, theirs = pair
    assert ours.encode(text) == theirs.encode(text).ids


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 49_151), max_size=30))
def test_decode_any_ids_equals_tokenizers(pair, ids):
    # Special tokens included; ids that cut UTF-8 characters become U+FFFD the same way.
    ours, theirs = pair
    ids = ids + [ours.vocab_size - 1]  # the last id: a special token for Llama 3, a plain token for SmolLM2
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False)


# Llama 3 tokens that are not what the merges make of their own text: " jeho" merges to three tokens, yet is 101503.
UNMERGEABLE = [" jeho", "ektedir", ".:.:.:.:.:.:.:.:", " tarihi", "lardan"]


@pytest.mark.parametrize("ignore_merges", [False, True])
def test_ignore_merges(tmp_path, ignore_merges):
    path = write_variant(tmp_path, REPOS[0], lambda spec: spec["model"].update(ignore_merges=ignore_merges))
    ours, theirs = BPETokenizer.from_tokenizer_json(path), Tokenizer.from_file(path)
    for text in UNMERGEABLE + [" ".join(UNMERGEABLE), "jeho jeho"]:
        assert ours.encode(text) == theirs.encode(text).ids
    assert (ours.encode(" jeho") == [128000, 101503]) == ignore_merges  # the setting changes ids: it is tested


def test_digits_and_nfc_variants(tmp_path, book):
    # Pre-tokenizer and normalizer steps these two files do not use, checked on modified copies.
    digits = {"type": "Digits", "individual_digits": True}
    text = book[:20_000] + " 1234567 ٣٤٥ ½²³ e\u0301 cafe\u0301 A\u030a Å <|im_start|>x"
    variants = [
        (REPOS[1], lambda spec: spec.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [digits, BYTE_LEVEL]})),
        (REPOS[0], lambda spec: spec["pre_tokenizer"]["pretokenizers"].insert(0, dict(digits, individual_digits=False))),
        (REPOS[1], lambda spec: spec.update(normalizer={"type": "NFC"})),
    ]
    for k, (repo, change) in enumerate(variants):
        folder = tmp_path / str(k)
        folder.mkdir()
        path = write_variant(folder, repo, change)
        ours, theirs = BPETokenizer.from_tokenizer_json(path), Tokenizer.from_file(path)
        assert ours.encode(text) == theirs.encode(text).ids, k


def test_split_isolated():
    import regex

    assert split_isolated(["ab12", "3"], regex.compile(r"\p{N}")) == ["ab", "1", "2", "3"]
    assert split_isolated(["ab12c"], regex.compile(r"\p{N}+")) == ["ab", "12", "c"]
    assert split_isolated([""], regex.compile("x")) == []


def pre_tokenizer_sequence(*steps):
    return lambda spec: spec.update(pre_tokenizer={"type": "Sequence", "pretokenizers": list(steps)})


@pytest.mark.parametrize("change, message", [
    (pre_tokenizer_sequence({"type": "Whitespace"}, BYTE_LEVEL), "pre_tokenizer type 'Whitespace' is not supported"),
    (pre_tokenizer_sequence({"type": "Metaspace"}), "must end with ByteLevel"),
    (pre_tokenizer_sequence(BYTE_LEVEL, {"type": "Digits"}, BYTE_LEVEL), "ByteLevel must be the last"),
    (pre_tokenizer_sequence({"type": "Split", "pattern": {"Regex": "x"}, "behavior": "Removed", "invert": False},
                            BYTE_LEVEL), "behavior 'Removed'"),
    (pre_tokenizer_sequence({"type": "Split", "pattern": {"Regex": "(?<x"}, "behavior": "Isolated", "invert": False},
                            BYTE_LEVEL), "does not compile"),
    (lambda s: s["pre_tokenizer"].update(add_prefix_space=True), "add_prefix_space"),
    (lambda s: s.update(normalizer={"type": "Lowercase"}), "normalizer type 'Lowercase'"),
    (lambda s: s.update(post_processor={"type": "BertProcessing"}), "post_processor type 'BertProcessing'"),
    (lambda s: s.update(decoder={"type": "Metaspace"}), "decoder type 'Metaspace'"),
    (lambda s: s["model"].update(type="WordPiece"), "model type 'WordPiece'"),
    (lambda s: s["model"].update(byte_fallback=True), "byte_fallback"),
    (lambda s: s["model"].update(unk_token="<unk>"), "unk_token"),
    (lambda s: s.update(truncation={"max_length": 8}), "truncation"),
    (lambda s: s["added_tokens"][0].update(lstrip=True), "lstrip"),
    (lambda s: s["model"]["merges"].append("a b c"), "not a pair"),
])
def test_unsupported_parts_are_named(tmp_path, change, message):
    path = write_variant(tmp_path, REPOS[1], change)
    with pytest.raises(ValueError, match=message):
        BPETokenizer.from_tokenizer_json(path)


def test_bad_input():
    smol = BPETokenizer.from_tokenizer_json(tokenizer_json(REPOS[1]))
    with pytest.raises(TypeError, match="str"):
        smol.encode(b"bytes")
    with pytest.raises(ValueError, match="49152"):
        smol.decode([49_152])
