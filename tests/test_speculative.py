"""Lesson 18's speculative decoding: greedy, token for token the output of lesson 08's generate (tiny configs with
many prompts and every k from 1 to 8, both stand-ins, both drafters, a repetition penalty, an EOS); sampling, the
model's distribution: the rejection rule's first two tokens counted over many seeded runs against the exact
probabilities of a tiny model with a vocabulary of 8 (Pearson's chi-square at a false-alarm rate of 0.001), two
wrong rules failing the same test, and the whole sampling loop passing it. Speed is measured by
benchmarks/speculative.py, never here."""

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hardway.decode.static import StaticDecodeStep  # lesson 12 (lesson 18 verifies with the latter)
from hardway.kernels.compile import rows_times_matrix
from hardway.decode.generate import generate
from hardway.formats.hub import checkpoint
from hardway.loading import load
from hardway.kernels.quantized import quantize_linears
from hardway.decode.sampling import SamplingConfig
from hardway.kernels.onednn import OneDNNLinear
from hardway.decode.speculative import (CompiledVerifier, Draft, Drafter, ModelDrafter, PromptLookupDrafter, SpeculationStats, Verifier, accept_greedy, accept_sampled, int8_drafter, speculative_generate)
from hardway.instruments.speculation import CostAwareGuesses, HeuristicGuesses, measure_verify_costs
from hardway.instruments.distributions import chi_square_test, draw_two_tokens, two_token_tables
from hardway.text.tokenizer import load_tokenizer

FALSE_ALARM = 1e-3  # a right rule fails a chi-square test at this threshold once in a thousand independent draws


def widened(model):
    with torch.no_grad():  # larger than the default init, so that the logits are far from uniform
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{name: (model, a second model of other weights)}: 2-layer GPT-2 and Llama (GQA, tied head), random weights."""
    out = {}
    for name in ("gpt2", "llama"):
        pair = []
        for weights in (0, 1):
            torch.manual_seed(weights)
            if name == "gpt2":
                hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=128, vocab_size=50))
            else:
                hf = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=96,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=128, tie_word_embeddings=True))
            folder = tmp_path_factory.mktemp(f"{name}-{weights}")
            widened(hf.eval()).save_pretrained(folder)
            pair.append(load(folder))
        out[name] = tuple(pair)
    return out


def prompts(vocab, n=4):
    """Random prompts of several lengths, and one that repeats itself (prompt lookup's case)."""
    g = torch.Generator().manual_seed(0)
    out = [torch.randint(0, vocab, (1, T), generator=g) for T in (1, 5, 11)[:n - 1]]  # n - 1 random prompts
    return out + [torch.tensor([[7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8]])]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_greedy_is_generates_tokens_on_tiny_configs_for_every_k(tiny, name):
    model, _ = tiny[name]
    int4 = ModelDrafter(quantize_linears(copy.deepcopy(model), 4, 32))  # a worse copy: more of its guesses rejected
    drafters = {"lookup": PromptLookupDrafter(), "int8": int8_drafter(model), "int4": int4}
    kept = {d: 0 for d in drafters}
    for ids in prompts(model.config.vocab_size, n=3):
        plain = generate(model, ids, max_new_tokens=16, eos_token_id=None)
        for k in range(1, 9):
            for drafter_name, drafter in drafters.items():
                stats = SpeculationStats()
                out = speculative_generate(model, ids, drafter, k, max_new_tokens=16, eos_token_id=None, stats=stats)
                assert torch.equal(out, plain), (drafter_name, k, ids.tolist())
                assert sum(stats.kept) + stats.steps == 15  # the first token comes from the prefill
                kept[drafter_name] += sum(stats.kept)
    assert all(kept.values()), kept  # every drafter had guesses kept: the rule and the rollback were exercised
    assert sum(stats.drafted) > sum(stats.kept)  # and guesses rejected


def test_greedy_is_generates_tokens_on_both_standins():
    """Real weights, short runs: prompt lookup at three k on each stand-in, and the int8 copy on GPT-2 (the exhaustive
    sweep of k and drafters is the tiny configs' test above; lesson 18 runs both drafters on both stand-ins too)."""
    for repo, text, ks, int8_k in (
            ("HuggingFaceTB/SmolLM2-135M-Instruct", "Repeat: the cat sat on the mat, the cat sat on the mat, the", (1, 3, 8), None),
            ("openai-community/gpt2", "The quick brown fox jumps over the lazy dog. The quick", (2, 5), 3)):
        folder = checkpoint(repo)
        model, tok = load(folder), load_tokenizer(folder)
        ids = torch.tensor([tok.encode(text)])
        plain = generate(model, ids, max_new_tokens=8)
        for k in ks:
            stats = SpeculationStats()
            out = speculative_generate(model, ids, PromptLookupDrafter(), k, max_new_tokens=8, stats=stats)
            assert torch.equal(out, plain), (repo, k)
            assert sum(stats.kept) > 0, (repo, k)  # guesses kept: the verify step and the rule ran on real weights
        if int8_k is not None:
            out = speculative_generate(model, ids, int8_drafter(model), int8_k, max_new_tokens=8)
            assert torch.equal(out, plain), repo


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_compiled_verify_step_is_generates_tokens_on_tiny_configs(tiny, name):
    """Lesson 12's static step and a verify graph of k + 1 positions, traced by dynamo and functionalized by
    AOTAutograd as inductor would receive them, run without code generation: plain greedy's tokens with drafts
    padded to k, steps without a guess (the one-position graph), the last steps of k = 8 eager (no k + 1 slots
    left), and one graph per k. benchmarks/speculative.py asserts the same tokens from inductor's code."""
    model, _ = tiny[name]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step = StaticDecodeStep(model, max_len=12 + 16 + 3, backend=counter)  # the longest prompt, 16 new, 3 slots more
    no_guess = short_draft = 0  # steps of the one-position graph, and drafts padded to k
    for k in (1, 3, 8):
        verifier = CompiledVerifier(step, k, backend=counter)
        for ids in prompts(model.config.vocab_size, n=3):
            plain = generate(model, ids, max_new_tokens=16, eos_token_id=None)
            stats = SpeculationStats()
            out = speculative_generate(model, ids, PromptLookupDrafter(), k, max_new_tokens=16, eos_token_id=None,
                                       verifier=verifier, stats=stats)
            assert torch.equal(out, plain), (k, ids.tolist())
            no_guess += stats.drafted.count(0)
            short_draft += sum(0 < m < k for m in stats.drafted)
    assert no_guess and short_draft, (no_guess, short_draft)
    assert counter.frame_count == 4, counter.frame_count  # one position, and k + 1 for each k


def test_several_compiled_sizes_run_the_smallest_graph_that_fits_and_give_generates_tokens(tiny):
    """One CompiledVerifier with graphs for 1, 2, 4 and 8 guesses, driven by both adaptive schedules: plain greedy's
    tokens, every draft run by the smallest graph that holds it (one graph per size that ran, and more than one
    size), and restricted_to(sizes) reusing those graphs without compiling another."""
    model, _ = tiny["llama"]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step = StaticDecodeStep(model, max_len=12 + 24 + 8, backend=counter)  # k + 1 slots always fit: no eager step
    verifier = CompiledVerifier(step, 8, backend=counter, sizes=(1, 2, 4))
    assert verifier.sizes == [1, 2, 4, 8]
    ran = set()
    for schedule in (HeuristicGuesses(8, first=2), CostAwareGuesses({1: 1.1, 2: 1.2, 4: 1.4, 8: 1.8})):
        for ids in prompts(model.config.vocab_size):
            plain = generate(model, ids, max_new_tokens=24, eos_token_id=None)
            stats = SpeculationStats()
            out = speculative_generate(model, ids, PromptLookupDrafter(), schedule, max_new_tokens=24,
                                       eos_token_id=None, verifier=verifier, stats=stats)
            assert torch.equal(out, plain), (type(schedule).__name__, ids.tolist())
            ran |= {next(s for s in verifier.sizes if s >= m) for m in stats.drafted if m}
    assert len(ran) > 1, ran
    assert counter.frame_count == 1 + len(ran), (counter.frame_count, ran)  # the plain step's graph and one a size
    padded = verifier.restricted_to([4])
    out = speculative_generate(model, prompts(model.config.vocab_size)[-1], PromptLookupDrafter(), 4,
                               max_new_tokens=24, eos_token_id=None, verifier=padded)
    assert torch.equal(out, generate(model, prompts(model.config.vocab_size)[-1], max_new_tokens=24,
                                     eos_token_id=None))
    assert counter.frame_count == 1 + len(ran | {4}), counter.frame_count
    with pytest.raises(ValueError, match="up to k = 4"):
        CompiledVerifier(step, 4, backend=counter, sizes=(8,))
    with pytest.raises(ValueError, match="not for all"):
        verifier.restricted_to([3])


def test_the_compiled_verify_step_multiplies_by_onednn_and_the_plain_step_keeps_its_products(tiny):
    """On a CPU in fp32 the graphs of k + 1 positions compute lesson 22's oneDNN twin of the step's model: every
    product one opaque hardway::onednn_linear (4 a layer: q, k and v stacked, o, gate and up stacked, down; and the
    head), on the step's own weights (the same Parameters; the twin adds a packed copy), while the step's
    one-position graph keeps torch's products. onednn=False: no oneDNN in the graph. Either way, plain greedy's
    tokens."""
    model, _ = tiny["llama"]
    n_products = 4 * model.config.num_hidden_layers + 1

    def recording(codes):
        def backend(graph_module, example_inputs):
            codes.append(graph_module.code)
            return graph_module.forward  # run as traced
        return backend

    ids = prompts(model.config.vocab_size)[-1]
    plain = generate(model, ids, max_new_tokens=16, eos_token_id=None)
    for onednn in (True, False):
        torch._dynamo.reset()
        step_codes, verify_codes = [], []
        step = StaticDecodeStep(model, max_len=12 + 16 + 4, backend=recording(step_codes))
        verifier = CompiledVerifier(step, 4, backend=recording(verify_codes), onednn=onednn)
        stats = SpeculationStats()
        right_then_wrong = ScriptedDrafter(plain[0], lambda N: N < ids.shape[1] + 8, model.config.vocab_size)
        for drafter in (PromptLookupDrafter(), right_then_wrong):
            out = speculative_generate(model, ids, drafter, 4, max_new_tokens=16, eos_token_id=None,
                                       verifier=verifier, stats=stats)
            assert torch.equal(out, plain), (onednn, type(drafter).__name__)
        assert stats.drafted.count(0) > 0 and 0 < sum(stats.kept) < sum(stats.drafted)  # both graphs decided tokens
        assert len(step_codes) == len(verify_codes) == 1
        assert "onednn_linear" not in step_codes[0]  # the plain step: lesson 12's graph, untouched
        assert verify_codes[0].count("hardway.onednn_linear") == (n_products if onednn else 0), onednn
        assert ({p.data_ptr() for p in verifier.rows_model.parameters()}
                == {p.data_ptr() for p in model.parameters()})  # no second copy of the Parameters
        assert (verifier.rows_model is model) == (not onednn)


def test_the_compiled_verify_step_on_onednn_is_generates_tokens_on_both_standins():
    """oneDNN sums the verify step's products in another order than torch's one-row products (fp32 rounding, about
    1e-6 relative): on real weights the argmax at every position must still be plain greedy's. The graphs traced by
    dynamo and run without code generation; the oneDNN products are computed for real (benchmarks/speculative.py
    asserts the same of inductor's code on SmolLM2)."""
    for repo, text in (("HuggingFaceTB/SmolLM2-135M-Instruct", "Repeat: the cat sat on the mat, the cat sat on the"),
                       ("openai-community/gpt2", "The quick brown fox jumps over the lazy dog. The quick")):
        folder = checkpoint(repo)
        model, tok = load(folder), load_tokenizer(folder)
        ids = torch.tensor([tok.encode(text)])
        plain = generate(model, ids, max_new_tokens=12)
        torch._dynamo.reset()
        step = StaticDecodeStep(model, max_len=ids.shape[1] + 12 + 4, backend="eager")
        verifier = CompiledVerifier(step, 4, backend="eager")
        assert any(isinstance(m, OneDNNLinear) for m in verifier.rows_model.modules()), repo
        stats = SpeculationStats()
        out = speculative_generate(model, ids, PromptLookupDrafter(), 4, max_new_tokens=12, verifier=verifier,
                                   stats=stats)
        assert torch.equal(out, plain), repo
        assert sum(stats.kept) > 0, repo  # guesses kept: the oneDNN verify step decided tokens


class ScriptedDrafter(Drafter):
    """Guesses the model's own continuation `reference` where `right(N)` says so, a wrong token elsewhere; records
    how many guesses each step asked for."""

    def __init__(self, reference, right, vocab_size):
        self.reference, self.right, self.vocab_size, self.asked = reference, right, vocab_size, []

    def start(self, input_ids, max_len):
        self.asked = []

    def propose(self, ids, k, sampling=None, generator=None):
        self.asked.append(k)
        N = ids.shape[0]
        guess = self.reference[N:N + k].clone()  # (m,)
        if not self.right(N):
            guess[0] = (guess[0] + 1) % self.vocab_size  # the first guess wrong: the step keeps none
        return Draft(guess)


def test_the_heuristic_schedule_grows_after_full_acceptance_and_shrinks_after_a_rejection():
    schedule = HeuristicGuesses(8, first=3)
    asked = []
    for drafted, kept in ((3, 3), (5, 5), (7, 7), (8, 2), (7, 0), (0, 0), (6, 6), (8, 8)):
        asked.append(schedule.guesses())
        schedule.update(drafted, kept)
    assert asked == [3, 5, 7, 8, 7, 6, 6, 8]  # +2 (capped at k), -1 per rejection, unchanged after no guess
    schedule.start()
    assert schedule.guesses() == 3  # a new generation starts over
    for _ in range(12):
        schedule.update(schedule.guesses(), 0)
    assert schedule.guesses() == 1  # never below one guess


def test_the_cost_aware_schedule_guesses_where_it_pays_and_stops_where_it_does_not():
    costs = {1: 1.3, 2: 1.5, 4: 1.9, 8: 2.6}  # a CPU-like verify step: every guess costs something
    schedule = CostAwareGuesses(costs)
    assert schedule.acceptance == 0.5 and schedule.guesses() == 2  # E(2) / c(2) = 1.75 / 1.5 beats 1.5 / 1.3 and 1
    for m in (2, 4, 8):
        schedule.update(m, m)
    assert schedule.acceptance > 0.85 and schedule.guesses() == 8  # every guess kept: the largest size
    rejections = 0
    while schedule.guesses() > 0:
        schedule.update(schedule.guesses(), 0)
        rejections += 1
    assert 2 <= rejections <= 8, rejections  # rejections: down to a plain step, at a plain step's cost
    plain_steps = 0
    while schedule.guesses() == 0:
        schedule.update(0, 0)
        plain_steps += 1
    assert 1 <= plain_steps <= 4 and schedule.guesses() == 1  # the evidence fades, and it tries one guess again
    free = CostAwareGuesses({1: 1.0, 4: 1.0})
    free.update(4, 0)
    assert free.guesses() == 4  # guesses that cost nothing are always worth making
    dear = CostAwareGuesses({4: 1.2}, draft_cost=0.5, patience=3)
    asked = []
    for drafted in (4, 0, 0, 0, 0):
        asked.append(dear.guesses())
        dear.update(drafted, 0)
    assert asked == [4, 0, 0, 0, 4]  # the first step probes; half a step a guess does not pay at a < 1/2; after 3
    # plain steps in a row, a probe again
    schedule.start()
    assert schedule.acceptance == 0.5  # a new generation starts over


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_adaptive_schedules_give_generates_tokens_and_follow_the_drafter(tiny, name):
    """Both schedules, with prompt lookup, the other model and a scripted drafter (right for some positions, then
    wrong): plain greedy's tokens; where the scripted guesses go wrong, the cost-aware schedule runs plain steps
    between probes of one guess, and the heuristic keeps guessing."""
    model, other = tiny[name]
    V = model.config.vocab_size
    for ids in prompts(V):
        plain = generate(model, ids, max_new_tokens=30, eos_token_id=None)
        T = ids.shape[1]
        for schedule in (HeuristicGuesses(6), CostAwareGuesses({1: 1.1, 3: 1.3, 6: 1.6})):
            scripted = ScriptedDrafter(plain[0], lambda N, T=T: N < T + 12, V)
            for drafter in (PromptLookupDrafter(), ModelDrafter(other), scripted):
                stats = SpeculationStats()
                out = speculative_generate(model, ids, drafter, schedule, max_new_tokens=30, eos_token_id=None,
                                           stats=stats)
                assert torch.equal(out, plain), (type(schedule).__name__, type(drafter).__name__, ids.tolist())
                assert max(stats.drafted) <= 6
    ids = prompts(V)[0]
    plain = generate(model, ids, max_new_tokens=60, eos_token_id=None)
    wrong_from = ids.shape[1] + 20  # the scripted guesses are right before this length, wrong after
    for schedule, most_plain in ((CostAwareGuesses({1: 1.35, 3: 1.7, 6: 2.1}), True), (HeuristicGuesses(6), False)):
        stats = SpeculationStats()
        speculative_generate(model, ids, ScriptedDrafter(plain[0], lambda N: N < wrong_from, V), schedule,
                             max_new_tokens=60, eos_token_id=None, stats=stats)
        lengths = ids.shape[1] + 1 + torch.tensor([0] + [k + 1 for k in stats.kept[:-1]]).cumsum(0)  # at each step
        right = [m for m, N in zip(stats.drafted, lengths.tolist()) if N < wrong_from]
        wrong = [m for m, N in zip(stats.drafted, lengths.tolist()) if N >= wrong_from + 4]
        assert max(right) == 6, stats.drafted  # right guesses: the most guesses
        assert (wrong.count(0) >= len(wrong) / 3) == most_plain, (type(schedule).__name__, wrong)  # plain steps


def test_measure_verify_costs_times_every_size(tiny):
    model, _ = tiny["gpt2"]
    costs = measure_verify_costs(Verifier(model, 32), (1, 4), pos=3, reps=1)
    assert set(costs) == {1, 4} and all(c > 0 for c in costs.values())


def test_rows_times_matrix_is_a_matrix_product():
    import torch._inductor.inductor_prims  # noqa: F401  registers the op that keeps `a` a buffer

    g = torch.Generator().manual_seed(0)
    for rows in (1, 5, 16):
        a, w = torch.randn(rows, 64, generator=g), torch.randn(96, 64, generator=g)  # w: (out, in), as a Linear's
        assert torch.allclose(rows_times_matrix(a, w.T), a @ w.T, atol=1e-5)


def test_a_verifier_whose_cache_is_too_short_is_refused(tiny):
    model, _ = tiny["gpt2"]
    with pytest.raises(ValueError, match="needs batch 1 x 9"):
        speculative_generate(model, torch.zeros(1, 3, dtype=torch.long), PromptLookupDrafter(), 2, max_new_tokens=6,
                             verifier=Verifier(model, 8))


def test_greedy_with_a_repetition_penalty_and_an_eos_is_generates(tiny):
    model, other = tiny["llama"]
    penalty = SamplingConfig(repetition_penalty=1.3)
    ids = prompts(model.config.vocab_size)[-1]
    for k in (1, 3, 6):
        for drafter in (PromptLookupDrafter(), ModelDrafter(other)):
            plain = generate(model, ids, 24, penalty, eos_token_id=None)
            assert torch.equal(speculative_generate(model, ids, drafter, k, 24, penalty, eos_token_id=None), plain)
    plain = generate(model, ids, 40, eos_token_id=None)[0, ids.shape[1]:]
    eos = int(plain[10])  # a token it produces: generation must stop right after its first occurrence
    expected = generate(model, ids, 40, eos_token_id=eos)
    assert expected.shape[1] < ids.shape[1] + 40
    for k in (1, 4, 8):
        assert torch.equal(speculative_generate(model, ids, PromptLookupDrafter(), k, 40, eos_token_id=eos), expected)
        assert torch.equal(speculative_generate(model, ids, ModelDrafter(other), k, 40, eos_token_id=eos), expected)


def test_the_rules_on_cases():
    assert accept_greedy(torch.tensor([5, 6, 7]), torch.tensor([5, 6, 9, 1])) == 2
    assert accept_greedy(torch.tensor([5, 6, 7]), torch.tensor([1, 6, 7, 1])) == 0  # a later match does not count
    assert accept_greedy(torch.tensor([], dtype=torch.long), torch.tensor([3])) == 0
    # A guess not drawn (q one-hot) of probability 1 is always kept; of probability 0 never, and the token drawn
    # instead is never the rejected guess.
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]]]).expand(1000, -1, -1)  # (B, 2, V)
    kept, nxt = accept_sampled(p, None, torch.ones(1000, 1, dtype=torch.long), torch.Generator().manual_seed(0))
    assert (kept == 1).all() and (nxt != 1).all()
    kept, nxt = accept_sampled(p, None, torch.zeros(1000, 1, dtype=torch.long), torch.Generator().manual_seed(0))
    assert (kept == 0).all() and (nxt == 1).all()


def test_prompt_lookup_guesses_what_followed_the_most_recent_match():
    d = PromptLookupDrafter()
    assert d.propose(torch.tensor([1, 2, 3, 9, 4, 1, 2, 3]), 3).tokens.tolist() == [9, 4, 1]
    assert d.propose(torch.tensor([1, 2, 3, 5, 1, 2, 3, 6, 0, 2, 3]), 2).tokens.tolist() == [6, 0]  # newest 2-gram
    assert d.propose(torch.tensor([1, 2, 3, 4]), 3).tokens.tolist() == []  # nothing to look up
    assert d.propose(torch.tensor([5, 5]), 4).tokens.tolist() == [5]  # only what exists after the match


def test_bad_arguments_are_refused_in_one_line(tiny):
    model, _ = tiny["gpt2"]
    for kwargs, words in ((dict(input_ids=torch.zeros(2, 3, dtype=torch.long)), "one prompt at a time"),
                          (dict(k=0), "k must be")):
        call = dict(input_ids=torch.zeros(1, 3, dtype=torch.long), k=2) | kwargs
        with pytest.raises(ValueError, match=words):
            speculative_generate(model, call["input_ids"], PromptLookupDrafter(), call["k"], max_new_tokens=4)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(min_ngram=0)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A tiny Llama of vocabulary 8, a second of other weights as its drafter, and the exact tables after a prompt."""
    models = []
    for weights in (1, 2):
        torch.manual_seed(weights)
        hf = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
        with torch.no_grad():
            for p in hf.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.5)
        folder = tmp_path_factory.mktemp(f"v8-{weights}")
        hf.save_pretrained(folder)
        models.append(load(folder))
    prompt = torch.tensor([3, 1, 4, 1])
    return models[0], models[1], prompt, two_token_tables(models[0], models[1], prompt)


def argmax_rule(p, q, draft, generator=None):  # wrong: keep a guess when it is the model's argmax, else draw from p
    kept = (draft == p[:, :draft.shape[1]].argmax(-1)).int().cumprod(1).sum(1)
    return kept, torch.multinomial(p[torch.arange(len(draft)), kept], 1, generator=generator)[:, 0]


def resample_from_p(p, q, draft, generator=None):  # wrong: the right acceptance, then a draw from p, not p - q
    kept, _ = accept_sampled(p, q, draft, generator)
    return kept, torch.multinomial(p[torch.arange(len(draft)), kept], 1, generator=generator)[:, 0]


def always_keep(p, q, draft, generator=None):  # wrong: the drafter's distribution, unchecked
    kept = torch.full((len(draft),), draft.shape[1])
    return kept, torch.multinomial(p[:, -1], 1, generator=generator)[:, 0]


def pair_p_value(rule, tables, n, seed=0):
    V = tables["p1"].shape[0]
    pairs = draw_two_tokens(rule, tables, n, torch.Generator().manual_seed(seed))
    counts = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).reshape(V, V)
    return chi_square_test(counts, tables["p1"][:, None] * tables["p2"])[2]


def test_the_rejection_rule_keeps_the_models_distribution_and_wrong_rules_do_not(small_vocab):
    *_, tables = small_vocab
    drafter_differs = 0.5 * (tables["p1"] - tables["q1"]).abs().sum()
    assert drafter_differs > 0.2, drafter_differs  # guesses are often rejected: the residual is really used
    assert pair_p_value(accept_sampled, tables, 200_000) > FALSE_ALARM
    for wrong in (argmax_rule, resample_from_p, always_keep):
        assert pair_p_value(wrong, tables, 200_000) < FALSE_ALARM, wrong.__name__


def test_the_chi_square_test_is_calibrated():
    """Counts drawn from the very probabilities tested: p-values spread over [0, 1], rarely below 0.05."""
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.04, 0.01])
    g = torch.Generator().manual_seed(0)
    p_values = torch.tensor([chi_square_test(torch.bincount(torch.multinomial(probs, 2000, True, generator=g),
                                                            minlength=6), probs)[2] for _ in range(400)])
    assert 0.02 < (p_values < 0.05).float().mean() < 0.09
    assert 0.4 < p_values.median() < 0.6


@pytest.mark.parametrize("drafter_kind", ["model", "lookup"])
def test_sampling_loop_keeps_the_models_distribution(small_vocab, drafter_kind):
    model, other, prompt, tables = small_vocab
    V = 8
    drafter = ModelDrafter(other) if drafter_kind == "model" else PromptLookupDrafter()
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(V * V, dtype=torch.long)
    stats = SpeculationStats()
    for _ in range(600):
        out = speculative_generate(model, prompt[None], drafter, k=3, max_new_tokens=3,
                                   sampling=SamplingConfig(do_sample=True), eos_token_id=None, generator=gen,
                                   stats=stats)
        counts[out[0, 4] * V + out[0, 5]] += 1
    assert sum(stats.drafted) > 0 and 0 < stats.acceptance < 1  # guesses made, some kept, some rejected
    assert chi_square_test(counts.reshape(V, V), tables["p1"][:, None] * tables["p2"])[2] > FALSE_ALARM


def test_the_command_line_speculates_with_the_same_text_and_refuses_bad_values(capsys):
    from hardway import cli

    base = ["generate", "--model", str(checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct")), "--device", "cpu",
            "--max-new-tokens", "6", "one two three one two three one two"]
    capsys.readouterr()  # the stand-in's banner, printed once per process by checkpoint()
    assert cli.main(base) == 0
    plain = capsys.readouterr().out
    assert cli.main(base + ["--speculate", "lookup", "--k", "3"]) == 0  # the int8 drafter: the tests above
    assert capsys.readouterr().out == plain
    for flags, words in ((["--speculate", "lookup", "--k", "0"], "--k must be"),
                         (["--speculate", "medusa"], "--speculate medusa"),
                         (["--k", "3"], "--k needs --speculate"),
                         (["--speculate", "lookup", "--k", "20", "--compile"], "--k must be in 1..15 with --compile")):
        assert cli.main(base + flags) == 2, flags
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], (flags, lines)


def test_the_command_line_speculates_on_the_compiled_step(tmp_path, monkeypatch, capsys):
    """generate --compile --speculate: lesson 12's step and lesson 18's CompiledVerifier, the text of plain decoding.
    A 2-layer Llama with the SmolLM2 stand-in's tokenizer, its graphs traced by dynamo and run without code
    generation (the "eager" backend): what is checked is the wiring, not inductor's code."""
    import shutil

    from hardway import cli
    from hardway.kernels import compile as compile_kernels

    standin = checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2))
    widened(hf.eval()).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(standin / name, tmp_path / name)
    capsys.readouterr()  # the stand-in's banner, printed once per process by checkpoint()
    verify_graphs = CompileCounterWithBackend("eager")
    # lesson 12's compiled_step picks the CPU backend by the rows of a step: one row "eager", k + 1 rows counted
    monkeypatch.setattr(compile_kernels, "cpu_step_backend", lambda rows=1: "eager" if rows == 1 else verify_graphs)
    base = ["generate", "--model", str(tmp_path), "--device", "cpu", "--max-new-tokens", "12",
            "one two three one two three one two"]
    assert cli.main(base) == 0
    plain = capsys.readouterr().out
    torch._dynamo.reset()
    assert cli.main(base + ["--compile", "--speculate", "int8", "--k", "3"]) == 0  # int8 guesses at every step
    assert capsys.readouterr().out == plain
    assert verify_graphs.frame_count == 1  # the verify steps ran through lesson 18's graph of k + 1 positions
