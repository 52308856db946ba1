"""Big grammars (lesson 25, section 9): the lazy DFA against the eager one and Python's `re`, the linear regex of
optional properties against outlines-core's language, the three schemas of benchmarks/grammar_compile.py compiled
under the default budget into JSON that validates, and the budget itself: a GrammarBudgetError that names it, a 400
in OpenAI's shape through the server, and a request whose grammar goes over it while generating ended alone."""

import json
import random
import re
import string

import jsonschema
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from hardway.decode.constrained import (EAGER_STATES, ConstrainedLogits, GrammarBudget, GrammarBudgetError,
                                        GrammarError, TokenAutomaton, compile_json_schema, naive_scan, token_vocabulary,
                                        trie_walk)
from hardway.decode.json_schema import json_schema_to_regex
from hardway.decode.regex_automaton import regex_to_dfa, regex_to_lazy_dfa
from hardway.engine.engine import Engine
from hardway.engine.sequence import SamplingParams
from hardway.formats.hub import checkpoint
from hardway.loading import load
from hardway.server.app import create_app
from hardway.text.chat import ChatTemplate
from test_server import alone
from test_structured_output import (EOS, SCHEMAS, SMOLLM2, compare_walks, outlines_vocabulary,  # noqa: F401
                                    run_grammar, tokenizer)

outlines_core = pytest.importorskip("outlines_core")
from outlines_core.json_schema import build_regex_from_schema  # noqa: E402


def big_schemas() -> dict[str, dict]:
    """The three schemas of benchmarks/grammar_compile.py, made the same way."""
    rng = random.Random(0)
    words: set[str] = set()
    while len(words) < 5000:
        words.add("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 12))))
    return {"enum": {"enum": sorted(words)},
            "strings": {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(40)}},
            "integers": {"type": "object", "properties": {f"count_{i}": {"type": "integer"} for i in range(20)}}}


def salted(schema: dict, salt: str) -> dict:
    """The same grammar under another cache key (a title is an annotation): compiled afresh, with its own budget."""
    return {**schema, "title": salt}


# ---------------------------------------------------------------- the lazy DFA is the eager DFA, made on demand


@pytest.mark.parametrize("pattern", [r"ab|c", r"(ab|cd)*e?", r"[0-9]{2,4}", r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
                                     r'"([^"\\]|\\["\\n])*"', r"(apple|apricot|ab|a)+x?", r"(é|ü|éa)z",
                                     r"a[^\s\S]|b", r"(abc|abd|b|)c{0,2}"])
def test_the_lazy_dfa_matches_what_the_eager_dfa_and_python_re_match(pattern):
    lazy, eager = regex_to_lazy_dfa(pattern), regex_to_dfa(pattern)
    rng = random.Random(pattern)
    alphabet = "abcdeprtxz019.-é\"\\nü "
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 7)))
        expected = re.fullmatch(pattern, text) is not None
        assert lazy.matches(text.encode()) == eager.matches(text.encode()) == expected, (pattern, text)


def test_a_lazy_dfa_makes_only_the_states_a_walk_visits():
    lazy = regex_to_lazy_dfa(json_schema_to_regex(big_schemas()["enum"]))
    assert lazy.n_states == 1  # the start
    value = big_schemas()["enum"]["enum"][1234]
    assert lazy.matches(json.dumps(value).encode())
    # a row for each byte read, each making the states one byte further on: tens of states, where the whole DFA of
    # the 5,000 values has 35,005 (benchmarks/grammar_compile.py)
    assert lazy.n_states < 100, lazy.n_states


def test_a_class_that_matches_nothing_leaves_no_dead_end_in_the_lazy_dfa():
    """`a[^\\s\\S]` can never be completed: the lazy DFA must not even offer the `a` (a mask would allow a token that
    leads nowhere)."""
    lazy = regex_to_lazy_dfa(r"a[^\s\S]|b")
    assert lazy.walk(b"a") == -1 and lazy.matches(b"b")
    with pytest.raises(GrammarError, match="matches no text"):
        regex_to_lazy_dfa(r"x[^\s\S]")


def test_the_lazy_automaton_allows_what_the_eager_one_allows(tokenizer):
    """Along random token walks, the masks from compile_json_schema (lazy) equal those of a TokenAutomaton on the
    minimal DFA, token for token."""
    vocabulary = token_vocabulary(tokenizer)
    schemas = list(SCHEMAS) + [{"enum": big_schemas()["enum"]["enum"][:300]},
                               {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(6)},
                                "required": ["p2", "p4"]}]
    for k, schema in enumerate(schemas):
        lazy = compile_json_schema(salted(schema, "lazy and eager"), tokenizer, [EOS])
        eager = TokenAutomaton(regex_to_dfa(json_schema_to_regex(schema)), vocabulary, [EOS])
        for seed in range(3):
            rng = random.Random(seed)
            ours, theirs = lazy.start, eager.start
            for _ in range(40):
                mine = lazy.allowed(ours)
                assert torch.equal(mine, eager.allowed(theirs)), (k, seed)
                token = rng.choice(np.flatnonzero(mine.numpy()).tolist())
                if token == EOS:
                    break
                ours, theirs = lazy.advance(ours, token), eager.advance(theirs, token)


def test_the_trie_walk_equals_the_naive_scan_on_every_state_of_a_lazy_dfa(tokenizer):
    automaton = compile_json_schema(salted(SCHEMAS[0], "every state"), tokenizer, [EOS])
    vocabulary, dfa = token_vocabulary(tokenizer), automaton.dfa
    state = 0
    while state < dfa.n_states:  # every state the lazy DFA can make, as the eager construction would
        dfa.expand(state)
        state += 1
    assert dfa.n_states > 40
    for state in range(0, dfa.n_states, 7):
        assert (trie_walk(dfa, vocabulary, state) == naive_scan(dfa, vocabulary, state)).all()


# ---------------------------------------------------------------- optional properties: a linear regex


def test_the_regex_of_optional_properties_grows_linearly():
    def regex_of(n):
        return json_schema_to_regex({"type": "object", "properties": {f"f{i:03}": {"type": "string"}
                                                                      for i in range(n)}})
    sizes = {n: len(regex_of(n)) for n in (20, 40, 80)}
    assert sizes[80] / sizes[40] < 2.1 and sizes[40] / sizes[20] < 2.1, sizes


@pytest.mark.parametrize("required", [[], ["c"], ["a", "e"], ["b", "c", "d"], ["a", "b", "c", "d", "e", "f"]])
def test_optional_properties_are_the_language_of_outlines_core(required, tokenizer, outlines_vocabulary):  # noqa: F811
    schema = {"type": "object", "properties": {name: {"type": "integer"} for name in "abcdef"}, "required": required}
    theirs = build_regex_from_schema(json.dumps(schema))
    compare_walks(theirs, compile_json_schema(schema, tokenizer, [EOS]), outlines_vocabulary, walks=4, steps=60)


# ---------------------------------------------------------------- the big schemas, under the default budget


@pytest.mark.parametrize("name", ["enum", "strings", "integers"])
def test_the_big_schemas_compile_lazily_and_give_json_that_validates(name, tokenizer):  # noqa: F811
    schema = big_schemas()[name]
    automaton = compile_json_schema(schema, tokenizer, [EOS])
    # a compile makes the rows of a small DFA (the objects': 2,723 and 563 states) and stops near EAGER_STATES on a big
    # one (the enum's whole DFA has 35,005)
    assert automaton.dfa.n_states < EAGER_STATES + 1000, automaton.dfa.n_states
    generator = torch.Generator().manual_seed(0)
    for sample in (False, True):
        text = run_grammar(automaton, tokenizer, generator, sample)
        jsonschema.validate(json.loads(text), schema)
    assert automaton.dfa.n_states < GrammarBudget().max_states // 2


# ---------------------------------------------------------------- the budget names itself


def test_each_budget_is_a_grammar_error_that_names_it(tokenizer):  # noqa: F811
    enum = big_schemas()["enum"]
    cases = [(GrammarBudget(max_states=3), "more than 3 automaton states (the state budget, max_states)"),
             (GrammarBudget(max_nfa_states=1000), "more than 1000 NFA states (the grammar size budget, "
                                                  "max_nfa_states)"),
             (GrammarBudget(compile_s=0), "took more than 0 s of CPU time to compile (the compile time budget, "
                                             "compile_s)")]
    for k, (budget, message) in enumerate(cases):
        with pytest.raises(GrammarBudgetError, match=re.escape(message)) as error:
            compile_json_schema(salted(enum, f"budget {k}"), tokenizer, [EOS], budget)
        assert isinstance(error.value, GrammarError)


def test_a_state_over_the_mask_budget_fails_while_generating(tokenizer):  # noqa: F811
    """compile_s covers the compile and its warm masks; a state found later gets mask_s for its own work."""
    schema = salted(big_schemas()["integers"], "mask budget")
    automaton = compile_json_schema(schema, tokenizer, [EOS], GrammarBudget(mask_s=0))
    ids = tokenizer.encode('{"count_3": 12, "count_7": -5}', add_special_tokens=False)
    processor = ConstrainedLogits(automaton, prompt_length=0)
    with pytest.raises(GrammarBudgetError, match=re.escape("one state's token mask (the per-state time budget, "
                                                           "mask_s)")):
        for n in range(len(ids) + 1):
            processor(torch.tensor([ids[:n]]), torch.zeros(1, automaton.vocab_size))


def test_a_cached_automaton_past_half_its_state_budget_is_compiled_afresh(tokenizer):  # noqa: F811
    schema = salted({"enum": big_schemas()["enum"]["enum"][:2000]}, "renewed")
    made = compile_json_schema(salted(schema, "count"), tokenizer, [EOS]).dfa.n_states  # what a compile makes
    budget = GrammarBudget(max_states=2 * made)
    first = compile_json_schema(schema, tokenizer, [EOS], budget)
    assert compile_json_schema(schema, tokenizer, [EOS], budget) is first  # at half: still the cached one
    state = first.advance(first.start, tokenizer.encoder[b'"'])
    for token in np.flatnonzero(first.allowed(state).numpy()).tolist():  # an answer goes on: more states
        first.allowed(first.advance(state, token))
        if first.dfa.n_states > made:
            break
    assert first.dfa.n_states > made
    renewed = compile_json_schema(schema, tokenizer, [EOS], budget)
    assert renewed is not first and renewed.dfa.n_states == made


# ---------------------------------------------------------------- the engine and the server


@pytest.fixture(scope="module")
def smollm2(tokenizer):  # noqa: F811
    folder = checkpoint(SMOLLM2)
    return load(folder), ChatTemplate.from_folder(folder)


class Boom(ValueError):
    pass


class FailsAtThirdToken:
    """A processor that raises when asked for the third token of its sequence."""

    def __init__(self, prompt_length: int):
        self.prompt_length = prompt_length

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] - self.prompt_length == 2:
            raise Boom("no third token")
        return scores


def test_a_row_whose_processor_raises_fails_alone(smollm2, tokenizer):  # noqa: F811
    model, _ = smollm2
    engine = Engine(model, tokenizer, n_blocks=64, block_size=16, max_batch=4)
    prompts = [tokenizer.encode(p) for p in ("The capital of France is", "One, two, three,", "Water boils at")]
    params = SamplingParams(max_tokens=5, temperature=0)
    seqs = [engine.add(prompts[0], params), engine.add(prompts[1], SamplingParams(max_tokens=5, temperature=0,
                                                                                  constraints=(FailsAtThirdToken,))),
            engine.add(prompts[2], params)]
    while engine.has_work():
        engine.step()
    assert seqs[1].finish_reason == "error" and "Boom: no third token" in seqs[1].error
    assert len(seqs[1].output_ids) == 2
    for seq, prompt in ((seqs[0], prompts[0]), (seqs[2], prompts[2])):  # as if it had never been there
        assert seq.finish_reason in ("stop", "length")
        assert seq.output_ids == alone(model, prompt, 5, model.eos_token_ids)


def chat_body(schema: dict, **fields) -> dict:
    return {"model": SMOLLM2, "messages": [{"role": "user", "content": "Give me some numbers as JSON."}],
            "max_tokens": 24, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "numbers", "schema": schema}}, **fields}


def test_a_schema_over_the_state_budget_is_a_400_naming_it(smollm2, tokenizer):  # noqa: F811
    model, chat = smollm2
    app = create_app(Engine(model, tokenizer, n_blocks=64, block_size=16, max_batch=4), SMOLLM2, chat,
                     grammar_budget=GrammarBudget(max_states=3))
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=chat_body(salted(big_schemas()["enum"], "server states")))
        assert r.status_code == 400
        assert r.json() == {"error": {
            "message": "'response_format': the grammar needs more than 3 automaton states (the state budget, "
                       "max_states)",
            "type": "invalid_request_error", "param": "response_format", "code": "grammar_budget_exceeded"}}
        tools = [{"type": "function", "function": {"name": "f", "parameters": salted(big_schemas()["integers"],
                                                                                     "server tools")}}]
        r = client.post("/v1/chat/completions", json={**chat_body({}), "response_format": None, "tools": tools,
                                                       "tool_choice": "required"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "(the state budget, max_states)" in r.json()["error"]["message"]
        plain = client.post("/v1/chat/completions", json={**chat_body({}), "response_format": None, "max_tokens": 4})
        assert plain.status_code == 200


def test_a_grammar_over_its_budget_while_generating_ends_that_request_alone(smollm2, tokenizer):  # noqa: F811
    """mask_s = 0: the compile (and its warm masks) passes, the first state found later fails. The request ends
    with a 400 naming the budget (an error event in a stream); the engine holds nothing of it, and answers the
    next request."""
    model, chat = smollm2
    engine = Engine(model, tokenizer, n_blocks=64, block_size=16, max_batch=4)
    app = create_app(engine, SMOLLM2, chat, grammar_budget=GrammarBudget(mask_s=0))
    budget_words = "went over its budget while generating: the grammar took more than 0 s of CPU time to compute one " \
                   "state's token mask (the per-state time budget, mask_s)"
    schema = {"type": "object", "properties": {"first": {"type": "integer"}, "second": {"type": "integer"}},
              "required": ["first", "second"]}
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=chat_body(salted(schema, "server mask")))
        assert r.status_code == 400 and budget_words in r.json()["error"]["message"], r.text
        with client.stream("POST", "/v1/chat/completions",
                           json=chat_body(salted(schema, "server mask, streamed"), stream=True)) as stream:
            events = [line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and budget_words in json.loads(events[-2])["error"]["message"]
        plain = client.post("/v1/chat/completions", json={**chat_body({}), "response_format": None, "max_tokens": 4})
        assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert not app.state.worker.pending and not engine.seqs
