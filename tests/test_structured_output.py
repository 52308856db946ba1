"""Constrained decoding (lesson 25): the regex -> DFA compiler against Python's `re`, the token masks against
outlines-core's Index on the same regexes and schemas, outputs that always parse and validate (jsonschema), and
GrammarError for what the compiler does not implement."""

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch

from hardway.decode.constrained import (ConstrainedLogits, GrammarError, compile_json_schema, compile_regex,
                                        naive_scan, token_vocabulary, trie_walk)
from hardway.decode.generate import generate
from hardway.decode.json_schema import json_schema_to_regex
from hardway.decode.regex_automaton import regex_to_dfa
from hardway.formats.hub import checkpoint
from hardway.loading import load
from hardway.text.tokenizer import load_tokenizer

outlines_core = pytest.importorskip("outlines_core")
from outlines_core.json_schema import build_regex_from_schema  # noqa: E402

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
EOS = 2  # SmolLM2-Instruct's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(checkpoint(SMOLLM2))


# ---------------------------------------------------------------- regex -> DFA, against Python's re


@pytest.mark.parametrize("pattern", [r"ab|c", r"[a-c]+x?", r"(ab|cd)*e?", r"[0-9]{2,4}", r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
                                     r"(?:é|ü)+\.", r'"([^"\\]|\\["\\n])*"', r"[^a-z]{0,3}z", r"a{3}|b{1,}"])
def test_dfa_matches_what_python_re_matches(pattern):
    dfa = regex_to_dfa(pattern)
    rng = random.Random(pattern)
    alphabet = "abcdexz019.-é\"\\nü "
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
        assert dfa.matches(text.encode()) == (re.fullmatch(pattern, text) is not None), (pattern, text)


@pytest.mark.parametrize("pattern,construct", [("^a", "anchor"), ("a*?", "lazy"), ("(?=a)b", "(?="), (r"(a)\1", "backreference"),
                                               (r"\bx", "word boundary"), ("[[:alpha:]]", "POSIX"), ("a{2,1}", "{2,1}"),
                                               ("(ab", "never closed"), ("a)", "unbalanced"), (r"\p{L}", "Unicode property")])
def test_regex_outside_the_subset_is_a_grammar_error(pattern, construct):
    with pytest.raises(GrammarError, match=re.escape(construct)):
        regex_to_dfa(pattern)


# ---------------------------------------------------------------- token masks, against outlines-core


@pytest.fixture(scope="module")
def outlines_vocabulary(tokenizer):
    vocabulary = token_vocabulary(tokenizer)
    by_bytes = {}
    for token_id, data in enumerate(vocabulary.token_bytes):
        if data is not None:
            by_bytes.setdefault(data, []).append(token_id)
    return outlines_core.Vocabulary(EOS, by_bytes)


def outlines_drops(automaton, state, token_id) -> bool:
    """outlines-core's Index keeps a token only if the state it ends in is not a regex-automata "match" state, or
    matches at the end of input. regex-automata reports a match one byte late, so a token whose last byte follows a
    point where the text was complete, and that leaves it incomplete, is dropped (e.g. "1" then "." in
    `[0-9]+(\\.[0-9]+)?`). We allow such tokens (they lead to valid texts); the comparison drops them on our side."""
    data = automaton.vocabulary.token_bytes[token_id]
    if data is None:
        return False
    before_last = automaton.dfa.walk(data[:-1], state)
    after = automaton.dfa.walk(data, state)
    return bool(automaton.dfa.accepting[before_last]) and not automaton.dfa.accepting[after]


def compare_walks(regex, ours, outlines_vocabulary, walks=4, steps=40):
    index = outlines_core.Index(regex, outlines_vocabulary)
    for seed in range(walks):
        rng = random.Random(seed)
        theirs_state, our_state = index.get_initial_state(), ours.start
        for step in range(steps):
            theirs = set(index.get_allowed_tokens(theirs_state))
            mask = ours.allowed(our_state).numpy()
            mine = set(np.flatnonzero(mask).tolist())
            extra = {t for t in mine - theirs if not outlines_drops(ours, our_state, t)}  # ours only, unexplained
            assert not extra and theirs <= mine, (regex[:80], seed, step, sorted(extra | (theirs - mine))[:10])
            assert ours.is_accepting(our_state) == index.is_final_state(theirs_state) == bool(mask[EOS])
            token = rng.choice(sorted(theirs))
            if token == EOS:
                break
            theirs_state = index.get_next_state(theirs_state, token)
            our_state = ours.advance(our_state, token)


@pytest.mark.parametrize("regex", [r"[0-9]{3}-[a-z]+", r"(true|false)", r'"[^"]*"', r"(ab|cd)*e?",
                                   r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5})*", r"-?[0-9]+(\.[0-9]+)?",
                                   r"(\+|-)?[0-9]+(, [0-9]+){0,3}", r"[^\n]{1,12}\n"])
def test_masks_equal_outlines_core_on_regexes(regex, tokenizer, outlines_vocabulary):
    compare_walks(regex, compile_regex(regex, tokenizer, [EOS]), outlines_vocabulary)


SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "boolean"}},
     "required": ["b"]},
    {"type": "object", "properties": {"n": {"type": "number"}, "l": {"type": "array", "items": {"type": "integer"},
                                                                     "maxItems": 3}}},
    {"type": "object", "properties": {"who": {"type": "object", "properties": {"name": {"type": "string",
                                                                                        "maxLength": 5}},
                                              "required": ["name"]},
                                      "tags": {"type": "array", "items": {"enum": ["x", "y", None]}, "minItems": 1}},
     "required": ["who", "tags"]},
    {"anyOf": [{"type": "integer"}, {"const": "a"}, {"type": "null"}]},
    {"type": "object", "properties": {"f": {"type": ["string", "null"]}}, "required": ["f"]},
]  # any JSON object (`{"type": "object"}`) is left out: outlines-core takes seconds to index its 293 states; lesson 25
#   and test_refs_to_defs_and_any_object check our side of it


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_masks_equal_outlines_core_on_schemas(schema, tokenizer, outlines_vocabulary):
    """Same whitespace (`[ ]?`), strings and numbers as outlines-core: the same allowed tokens along every walk."""
    theirs = build_regex_from_schema(json.dumps(schema))
    compare_walks(theirs, compile_json_schema(schema, tokenizer, [EOS]), outlines_vocabulary, walks=3, steps=60)


def test_trie_walk_equals_the_naive_scan(tokenizer):
    automaton = compile_json_schema(SCHEMAS[0], tokenizer, [EOS])
    vocabulary = token_vocabulary(tokenizer)
    for state in range(0, automaton.dfa.n_states, 7):
        assert (trie_walk(automaton.dfa, vocabulary, state) == naive_scan(automaton.dfa, vocabulary, state)).all()


# ---------------------------------------------------------------- the automaton and the processor


def test_compiled_once_per_schema_and_tokenizer_and_masks_cached(tokenizer):
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    first = compile_json_schema(schema, tokenizer, [EOS])
    assert compile_json_schema(json.loads(json.dumps(schema)), tokenizer, [EOS]) is first
    assert first.allowed(first.start) is first.allowed(first.start)
    assert compile_regex("[0-9]+", tokenizer, [EOS]) is compile_regex("[0-9]+", tokenizer, [EOS])


def test_the_trap_token_that_ends_a_string_and_writes_the_comma_is_allowed(tokenizer):
    """`",` is one token of SmolLM2's vocabulary and the one its tokenizer uses after a string value."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    automaton = compile_json_schema(schema, tokenizer, [EOS])
    text = '{"name": "Alice", "age": 30}'
    ids = tokenizer.encode(text, add_special_tokens=False)
    comma = tokenizer.encoder[b'",']
    assert comma in ids
    state = automaton.start
    for token in ids:
        assert automaton.allowed(state)[token], tokenizer.decoder[token]
        state = automaton.advance(state, token)
    assert automaton.is_accepting(state) and automaton.allowed(state)[EOS]


def test_processor_masks_padding_columns_and_allows_eos_only_where_accepting(tokenizer):
    automaton = compile_regex("[0-9]{1,2}", tokenizer, [EOS])
    processor = ConstrainedLogits(automaton, prompt_length=3)
    width = automaton.vocab_size + 64  # the model's head is wider than the tokenizer: padding rows
    ids = torch.tensor([[5, 6, 7]])
    scores = processor(ids, torch.zeros(1, width))
    assert torch.isinf(scores[0, automaton.vocab_size:]).all() and torch.isinf(scores[0, EOS])
    one = tokenizer.encoder[b"4"]
    scores = processor(torch.tensor([[5, 6, 7, one]]), torch.zeros(1, width))
    assert scores[0, EOS] == 0 and scores[0, tokenizer.encoder[b"2"]] == 0  # "4" is complete, "42" too
    with pytest.raises(ValueError, match="not allowed"):
        processor(torch.tensor([[5, 6, 7, one, tokenizer.encoder[b"a"]]]), torch.zeros(1, width))


# ---------------------------------------------------------------- random schemas, every output valid


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    scalar = [lambda: {"type": "string", "maxLength": rng.randint(0, 6)}, lambda: {"type": "string"},
              lambda: {"type": "integer"}, lambda: {"type": "number"}, lambda: {"type": "boolean"},
              lambda: {"type": "null"}, lambda: {"enum": rng.sample(["red", "green", 3, None, True], 2)},
              lambda: {"const": rng.choice(["on", 7, [1, "a"]])}]
    if depth >= 2 or rng.random() < 0.35:
        return rng.choice(scalar)()
    kind = rng.choice(["object", "object", "array", "anyOf"])
    if kind == "object":
        names = rng.sample(["id", "name", "tags", "score", "ok", "child"], rng.randint(1, 3))
        properties = {n: random_schema(rng, depth + 1) for n in names}
        return {"type": "object", "properties": properties, "required": rng.sample(names, rng.randint(0, len(names)))}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low, "maxItems": low + 2}
    return {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"v": random_schema(rng, depth + 1)},
                                            "required": ["v"]}]}


def run_grammar(automaton, tokenizer, rng: torch.Generator, sample: bool, budget: int = 300) -> str:
    """Decode under the mask from random scores that favour closing punctuation: a model that writes anything, so
    the grammar alone makes the text valid (and the bias ends the strings and numbers within the budget)."""
    vocabulary = token_vocabulary(tokenizer)
    closing = torch.zeros(automaton.vocab_size)
    for token_id, data in enumerate(vocabulary.token_bytes):
        if data is not None and set(data) <= set(b'"]},: '):
            closing[token_id] = 9.0
    closing[EOS] = 9.0
    processor = ConstrainedLogits(automaton, prompt_length=0)
    ids = []
    for _ in range(budget):
        scores = torch.randn(1, automaton.vocab_size, generator=rng) * 2 + closing  # (1, V)
        scores = processor(torch.tensor([ids], dtype=torch.long).reshape(1, -1), scores)
        token = int(torch.multinomial(scores.softmax(-1)[0], 1, generator=rng)) if sample else int(scores.argmax())
        if token == EOS:
            return b"".join(vocabulary.token_bytes[i] for i in ids).decode()
        ids.append(token)
    raise AssertionError(f"no EOS within {budget} tokens: {b''.join(vocabulary.token_bytes[i] for i in ids)!r}")


@pytest.mark.parametrize("seed", range(12))
def test_random_schemas_always_give_json_that_validates(seed, tokenizer):
    rng = random.Random(seed)
    schema = random_schema(rng)
    automaton = compile_json_schema(schema, tokenizer, [EOS])
    generator = torch.Generator().manual_seed(seed)
    for sample in (False, True):
        text = run_grammar(automaton, tokenizer, generator, sample)
        jsonschema.validate(json.loads(text), schema)


# ---------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def smollm2():
    return load(checkpoint(SMOLLM2))


def chat(tokenizer, text: str) -> torch.Tensor:
    prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return torch.tensor([tokenizer.encode(prompt)])


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.mark.parametrize("question,regex", [("What is the capital of France? Answer in one word.", r"[A-Za-z ]+\."),
                                            ("How many legs does a spider have? Answer with a number only.",
                                             r"[A-Za-z0-9 ]+\.")])
def test_a_greedy_answer_already_valid_is_unchanged(question, regex, smollm2, tokenizer):
    """A mask that keeps the model's own greedy choice at every step changes nothing. (The stand-in writes its JSON
    pretty-printed, over several lines, which the `[ ]?` whitespace does not allow: the property is shown on regexes.)"""
    ids = chat(tokenizer, question)
    free = generate(smollm2, ids, 16)
    answer = free[0, ids.shape[1]:].tolist()
    assert answer[-1] == EOS and re.fullmatch(regex, tokenizer.decode(answer[:-1]))  # the premise: already valid
    constrained = generate(smollm2, ids, 16, regex=regex, tokenizer=tokenizer)
    assert constrained.tolist() == free.tolist()


def test_model_output_under_a_schema_and_a_regex_is_valid(smollm2, tokenizer):
    ids = chat(tokenizer, "Describe a person named Bob in JSON.")
    rows = generate(smollm2, ids.repeat(2, 1), 40, json_schema=PERSON, tokenizer=tokenizer, do_sample=True,
                    temperature=1.0, generator=torch.Generator().manual_seed(0))
    for row in rows:
        answer = row[ids.shape[1]:].tolist()
        assert EOS in answer, tokenizer.decode(answer)
        jsonschema.validate(json.loads(tokenizer.decode(answer[:answer.index(EOS)])), PERSON)
    ids = chat(tokenizer, "What year did the Berlin wall fall?")
    out = generate(smollm2, ids, 8, regex=r"[0-9]{4}", tokenizer=tokenizer)[0, ids.shape[1]:].tolist()
    assert out[-1] == EOS and re.fullmatch(r"[0-9]{4}", tokenizer.decode(out[:-1]))


def test_the_package_generate_passes_the_grammar_on(smollm2, tokenizer):
    """`hardway.generate` (lesson 12's fast_generate) passes json_schema, regex and tokenizer on to lesson 08's loop
    (the compiled step changes only the decoder it passes, so eager=True keeps this test from compiling)."""
    import hardway

    ids = chat(tokenizer, "What year did the Berlin wall fall?")
    eager = hardway.generate(smollm2, ids, 8, regex=r"[0-9]{4}", tokenizer=tokenizer, eager=True)
    assert eager.tolist() == generate(smollm2, ids, 8, regex=r"[0-9]{4}", tokenizer=tokenizer).tolist()
    answer = eager[0, ids.shape[1]:].tolist()
    assert answer[-1] == EOS and re.fullmatch(r"[0-9]{4}", tokenizer.decode(answer[:-1]))
    with pytest.raises(ValueError, match="tokenizer"):
        hardway.generate(smollm2, ids, 8, json_schema=PERSON, eager=True)


# ---------------------------------------------------------------- what is not supported, said where


@pytest.mark.parametrize("schema,keyword,where", [
    ({"type": "string", "pattern": "a+"}, "'pattern'", "#/pattern"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}, "'minimum'",
     "#/properties/a/minimum"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "'patternProperties'", "#/patternProperties"),
    ({"if": {"type": "string"}, "then": {"maxLength": 3}}, "'if'", "#/if"),
    ({"type": "array", "items": {"type": "strin"}}, "'strin'", "#/items/type"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "'b'", "#/required"),
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
     "recursive $ref", "#/$ref/properties/next/$ref"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": True}, "additionalProperties",
     "#/additionalProperties"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "maxItems 1", "#"),
    ({"type": "object", "properties": {"a": []}}, "must be a JSON object", "#/properties/a"),
])
def test_unsupported_or_malformed_schemas_name_the_keyword_and_where(schema, keyword, where, tokenizer):
    with pytest.raises(GrammarError) as error:
        compile_json_schema(schema, tokenizer, [EOS])
    assert keyword in str(error.value) and f"at {where} " in str(error.value), str(error.value)
    assert isinstance(error.value, ValueError)


def test_refs_to_defs_and_any_object():
    schema = {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
              "type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2}
    dfa = regex_to_dfa(json_schema_to_regex(schema))
    assert dfa.matches(b'[{"x": 1}, {"x": 2}]') and not dfa.matches(b'[{"y": 1}]')
    anything = regex_to_dfa(json_schema_to_regex(None))
    assert anything.matches(b'{"a": [1, {"b": null}], "c": "d"}') and not anything.matches(b"[1]")
