"""The public API (docs/api.md) keeps the calls it documents, and follows transformers where a reader expects it.

docs/api.md is read here, so the page and the package cannot drift apart: `hardway.__all__` is exactly its list of
names, and every parameter it writes exists, in its order, with its default. Then the calls themselves, on tiny
GPT-2 and Llama configs saved by transformers (only equivalence matters there): transformers' sampling keywords and
`SamplingConfig` give the same tokens, greedy ones equal transformers' `generate`, giving both is refused, and a
model loaded on CPU in fp32 (its matrices laid out for decoding, lesson 12) and then moved with `.to()` computes what
`load(..., dtype=...)` computes. The page's own example runs on the GPT-2 stand-in.
"""

import ast
import copy
import inspect
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import GPT2LMHeadModel, LlamaForCausalLM

import hardway
from hardway.decode.sampling import SamplingConfig, sampling_config
from hardway.decode.speculative import PromptLookupDrafter, speculative_generate
from test_fast_decode import save_tiny_models  # tests/ is on sys.path under pytest

ROOT = Path(__file__).resolve().parent.parent
API_PAGE = ROOT / "docs" / "api.md"


# ---- the page ----------------------------------------------------------------------------------------------------

def documented_calls() -> list[tuple[int, str, str | None]]:
    """(heading level, dotted name, parameter list or None) of every `### \\`...\\`` and `#### \\`...\\`` heading in
    the page's "## The names" section."""
    text = API_PAGE.read_text(encoding="utf-8")
    section = text.split("\n## The names\n", 1)[1].split("\n## ", 1)[0]
    calls = []
    for level, inside in re.findall(r"^(#{3,4}) `([^`]+)`\s*$", section, flags=re.M):
        name, _, params = inside.partition("(")
        calls.append((len(level), name, params[:-1] if params else None))
    return calls


def documented_names() -> list[str]:
    return [name for level, name, _ in documented_calls() if level == 3]


def resolve_public(dotted: str):
    obj = hardway
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_page_lists_names_and_calls():
    names = documented_names()
    assert len(names) == len(set(names)) >= 5, names
    assert any(params for _, _, params in documented_calls())


def test_all_is_exactly_the_documented_list():
    assert sorted(hardway.__all__) == sorted(documented_names())
    assert len(hardway.__all__) == len(set(hardway.__all__))


def test_every_public_name_imports_in_a_fresh_interpreter():
    """`from hardway import *` and each name by attribute, in a child, so no other test has imported anything first;
    each name is the object of the module the lessons build it in, and `import hardway` alone loads no model code."""
    child = ("import sys, hardway\n"
             "assert 'hardway.decode.generate' not in sys.modules and 'torch' not in sys.modules, 'import hardway is not lazy'\n"
             "ns = {}\n"
             "exec('from hardway import *', ns)\n"
             "missing = [n for n in hardway.__all__ if n not in ns]\n"
             "assert not missing, missing\n"
             "import hardway.decode.generate, hardway.loading, hardway.decode.sampling, hardway.text.tokenizer\n"
             "import hardway.decode.static\n"
             "assert hardway.generate is hardway.decode.static.fast_generate and hardway.load is hardway.loading.load\n"
             "assert hardway.SamplingConfig is hardway.decode.sampling.SamplingConfig\n"
             "print(sorted(hardway.__all__))\n")
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(sorted(documented_names()))
    with pytest.raises(AttributeError, match="no attribute 'decode_layout'"):
        hardway.decode_layout  # internal: reached by its module path, not from `hardway`


def parsed_params(params: str) -> inspect.Signature:
    """The page's parameter list as a Signature; a default of `...` stands for one described in words."""
    tree = ast.parse(f"def documented({params}): pass").body[0].args

    def value(node):
        return eval(compile(ast.Expression(node), "api.md", "eval"), {"torch": torch})

    kinds = [(a, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in tree.args]
    kinds += [(a, inspect.Parameter.KEYWORD_ONLY) for a in tree.kwonlyargs]
    defaults = [None] * (len(tree.args) - len(tree.defaults)) + list(tree.defaults) + list(tree.kw_defaults)
    return inspect.Signature([inspect.Parameter(a.arg, kind, default=inspect.Parameter.empty if d is None else value(d))
                              for (a, kind), d in zip(kinds, defaults)])


@pytest.mark.parametrize("dotted,params", [(n, p) for _, n, p in documented_calls() if p is not None])
def test_documented_signature_is_the_real_one(dotted, params):
    """Every documented parameter exists with its documented kind and default; the positional ones in the documented
    order, first. Parameters the page does not write (internal ones) may follow."""
    documented = parsed_params(params)
    actual = inspect.signature(resolve_public(dotted))
    actual_params = list(actual.parameters.values())
    positional = [p for p in documented.parameters.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in actual_params[:len(positional)]] == [p.name for p in positional], actual
    for p in documented.parameters.values():
        assert p.name in actual.parameters, f"{dotted} has no parameter {p.name!r}: {actual}"
        real = actual.parameters[p.name]
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            assert real.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD), real
        else:
            assert real.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, real
        if p.default is not Ellipsis:
            assert real.default is p.default or real.default == p.default, f"{dotted}: {real} documented as {p}"


def test_causal_lm_members_are_the_documented_ones():
    """The page's "Members:" of CausalLM are the Protocol's members, no more, no fewer."""
    text = API_PAGE.read_text(encoding="utf-8").split("### `CausalLM`", 1)[1].split("Members:", 1)[1].split("\n\n")[0]
    documented = {m.split("(")[0] for m in re.findall(r"`([^`]+)`", text)}
    protocol = set(hardway.CausalLM.__annotations__) | {n for n in vars(hardway.CausalLM) if not n.startswith("_")}
    assert documented == protocol


def test_the_pages_example_runs_on_the_gpt2_standin():
    """The page's first Python block, as written, on the GPT-2 stand-in (its two generate calls and the forward)."""
    code = API_PAGE.read_text(encoding="utf-8").split("```python\n", 1)[1].split("```", 1)[0]
    ns = {}
    exec(compile(code, "api.md", "exec"), ns)
    T = ns["input_ids"].shape[1]
    assert ns["out"].shape[0] == 1 and T < ns["out"].shape[1] <= T + 20
    assert ns["logits"].shape == (1, T, 50257)


# ---- tiny models ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """test_fast_decode's tiny GPT-2 and Llama, with room for 96 positions: {name: (folder, reference)}."""
    return save_tiny_models(tmp_path_factory, positions=96)


def ids_for(vocab: int, T: int = 7, B: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def reference_generate(reference, input_ids, **kwargs):
    with torch.inference_mode():
        return reference.generate(input_ids, attention_mask=torch.ones_like(input_ids), eos_token_id=None,
                                  pad_token_id=0, **kwargs)


def test_greedy_keywords_equal_the_default_and_transformers_greedy(tiny):
    """The README's call, `generate(model, input_ids, max_new_tokens=50, do_sample=False)`: plain greedy, token for
    token transformers' generate(do_sample=False)."""
    folder, reference = tiny["gpt2"]
    model = hardway.load(folder)
    ids = ids_for(100)
    out = hardway.generate(model, ids, max_new_tokens=50, do_sample=False, eos_token_id=None)
    assert out.shape == (1, 7 + 50)
    assert torch.equal(out, hardway.generate(model, ids, 50, eos_token_id=None))
    assert torch.equal(out, reference_generate(reference, ids, max_new_tokens=50, do_sample=False))


def test_greedy_ignores_sampling_settings_as_transformers_does(tiny):
    """do_sample=False with a temperature, top_k, top_p: checked, then unused (transformers warns and ignores them);
    the repetition penalty applies greedy too, in both."""
    folder, reference = tiny["gpt2"]
    model = hardway.load(folder)
    ids = ids_for(100, seed=1)
    greedy = hardway.generate(model, ids, 12, eos_token_id=None)
    assert torch.equal(hardway.generate(model, ids, 12, do_sample=False, temperature=0.3, top_k=3, top_p=0.5,
                                        eos_token_id=None), greedy)
    assert torch.equal(hardway.generate(model, ids, 12, temperature=0.3, eos_token_id=None), greedy)
    penalised = hardway.generate(model, ids, 12, repetition_penalty=1.5, eos_token_id=None)
    assert torch.equal(penalised, reference_generate(reference, ids, max_new_tokens=12, do_sample=False,
                                                     repetition_penalty=1.5))
    with pytest.raises(ValueError, match="top_p"):
        hardway.generate(model, ids, 12, do_sample=False, top_p=1.5)  # checked even when unused


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_sampling_keywords_equal_the_sampling_config_spelling(tiny, name):
    folder, _ = tiny[name]
    model = hardway.load(folder)
    ids = ids_for(100, seed=2)
    settings = dict(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2)

    def run(*args, **kwargs):
        return hardway.generate(model, ids, 10, *args, eos_token_id=None, generator=torch.Generator().manual_seed(3),
                                **kwargs)

    keywords = run(do_sample=True, **settings)
    assert torch.equal(keywords, run(SamplingConfig(do_sample=True, **settings)))  # the fourth argument
    assert torch.equal(keywords, run(sampling=SamplingConfig(do_sample=True, **settings)))
    assert not torch.equal(keywords, run(do_sample=False, **settings))  # sampling did happen


def test_do_sample_alone_is_transformers_default_top_k(tiny):
    """transformers samples among the 50 most likely tokens unless told otherwise; so do the keywords (a
    SamplingConfig fills nothing in). With torch's global generator seeded alike, transformers' tokens."""
    folder, reference = tiny["gpt2"]
    model = hardway.load(folder)
    ids = ids_for(100, seed=4)
    assert sampling_config(do_sample=True) == SamplingConfig(do_sample=True, top_k=50)
    assert sampling_config(do_sample=np.True_) == sampling_config(do_sample=True)  # numpy's bool, as a bool
    assert sampling_config(do_sample=True, top_k=0).processors() == []  # top_k=0: the whole vocabulary
    assert SamplingConfig(do_sample=True).top_k is None
    for seed in (0, 1):
        torch.manual_seed(seed)
        ours = hardway.generate(model, ids, 8, do_sample=True, temperature=1.5, eos_token_id=None)
        torch.manual_seed(seed)
        theirs = reference_generate(reference, ids, max_new_tokens=8, do_sample=True, temperature=1.5)
        assert torch.equal(ours, theirs), seed
    g = torch.Generator().manual_seed(9)
    a = hardway.generate(model, ids, 8, do_sample=True, temperature=1.5, eos_token_id=None, generator=g)
    g = torch.Generator().manual_seed(9)
    b = hardway.generate(model, ids, 8, SamplingConfig(do_sample=True, temperature=1.5, top_k=50), eos_token_id=None,
                         generator=g)
    assert torch.equal(a, b)


def test_both_spellings_in_one_call_are_refused_naming_both(tiny):
    folder, _ = tiny["gpt2"]
    model = hardway.load(folder)
    ids = ids_for(100)
    with pytest.raises(ValueError, match=r"sampling=SamplingConfig\(do_sample=True.*do_sample=True"):
        hardway.generate(model, ids, 5, SamplingConfig(do_sample=True), do_sample=True)
    with pytest.raises(ValueError, match=r"sampling=.*top_k=5"):
        hardway.generate(model, ids, 5, sampling=SamplingConfig(), top_k=5)
    with pytest.raises(ValueError, match="sampling=.*temperature=0.7"):
        speculative_generate(model, ids, PromptLookupDrafter(), 2, 5, SamplingConfig(), temperature=0.7)
    with pytest.raises(ValueError, match="do_sample must be True or False"):
        hardway.generate(model, ids, 5, do_sample="yes")
    with pytest.raises(ValueError, match="must be a hardway.decode.sampling.SamplingConfig"):
        hardway.generate(model, ids, 5, True)  # do_sample given as the fourth argument


def test_speculative_generate_takes_the_same_keywords(tiny):
    folder, _ = tiny["gpt2"]
    model = hardway.load(folder)
    ids = ids_for(100, seed=5)
    greedy = speculative_generate(model, ids, PromptLookupDrafter(), 3, max_new_tokens=12, do_sample=False,
                                  eos_token_id=None)
    assert torch.equal(greedy, hardway.generate(model, ids, 12, eos_token_id=None))
    a = speculative_generate(model, ids, PromptLookupDrafter(), 3, max_new_tokens=8, do_sample=True, top_k=10,
                             eos_token_id=None, generator=torch.Generator().manual_seed(1))
    b = speculative_generate(model, ids, PromptLookupDrafter(), 3, max_new_tokens=8,
                             sampling=SamplingConfig(do_sample=True, top_k=10), eos_token_id=None,
                             generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)


# ---- load, and the model moved ------------------------------------------------------------------------------------

def strides(model) -> list[tuple[int, ...]]:
    return [p.stride() for p in model.parameters()]


def logits(model, ids) -> torch.Tensor:
    return hardway.forward_once(model, ids).float()  # (B, T, V)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_model_cast_after_load_computes_what_load_in_that_dtype_computes(tiny, name, dtype):
    """load() on CPU in fp32 lays the matrices out for decoding; `.to(dtype)` gives them back the layout load gives in
    that dtype, and Llama's RoPE frequencies stay fp32: the logits are load(dtype=...)'s exactly, and close to
    transformers' loaded in that dtype."""
    folder, _ = tiny[name]
    ids = ids_for(100, T=80, B=2)  # long enough that a half-precision inv_freq would move the angles
    moved = hardway.load(folder).to(dtype)
    loaded = hardway.load(folder, dtype=str(dtype).removeprefix("torch."))  # the dtype by name
    assert all(p.dtype == dtype for p in moved.parameters())
    assert strides(moved) == strides(loaded)
    if name == "llama":
        assert moved.rope.inv_freq.dtype == torch.float32 and moved.lm_head.weight is moved.tok_emb.weight
    assert moved.new_kv_cache(1, 4).k.dtype == dtype
    ours = logits(moved, ids)
    assert torch.equal(ours, logits(loaded, ids))
    Reference = GPT2LMHeadModel if name == "gpt2" else LlamaForCausalLM
    with torch.inference_mode():
        theirs = Reference.from_pretrained(folder, dtype=dtype).eval()(ids).logits.float()  # (B, T, V)
        exact = Reference.from_pretrained(folder, dtype=torch.float32).eval()(ids).logits  # (B, T, V)
    # No further from transformers' fp32 logits than transformers' own, give or take a few steps of the dtype.
    step = torch.finfo(dtype).eps * exact.abs().max().item()
    assert (ours - exact).abs().max() <= (theirs - exact).abs().max() + 4 * step


@pytest.mark.parametrize("spelling", ["half", "to"])
def test_half_then_float_lays_the_matrices_out_for_decoding_again(tiny, spelling):
    """Back on CPU in fp32, the decode layout again (what load gives there), and RoPE's frequencies as computed."""
    folder, _ = tiny["llama"]
    model = hardway.load(folder)
    laid_out, inv_freq = strides(model), model.rope.inv_freq.clone()  # (d/2,) fp32
    model = model.half().float() if spelling == "half" else model.to(torch.float16).to("cpu", torch.float32)
    assert strides(model) == laid_out
    assert torch.equal(model.rope.inv_freq, inv_freq)  # never rounded to fp16 on the way
    assert next(model.parameters()).dtype == torch.float32
    ids = ids_for(120, T=9)
    torch.testing.assert_close(logits(model, ids), logits(hardway.load(folder), ids), atol=0.05, rtol=0.01)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_model_moved_to_another_device_has_the_layout_load_gives_there(tiny, name):
    """`.to("cuda")` cannot run here; the meta device takes the same path (a device where the decode layout does not
    pay): every matrix back in the strides it was loaded with, the RoPE frequencies fp32 there, the head still tied,
    a new cache on that device. A deep copy (what the serving engine makes) keeps the record."""
    folder, _ = tiny[name]
    plain = strides(hardway.load(folder, dtype=torch.bfloat16))  # the file's layout, as load gives it off CPU fp32
    for model in (hardway.load(folder), copy.deepcopy(hardway.load(folder))):
        assert strides(model) != plain  # laid out for decoding
        model.to("meta")
        assert all(p.device.type == "meta" and p.dtype == torch.float32 for p in model.parameters())
        assert strides(model) == plain
        assert model.new_kv_cache(1, 4).k.device.type == "meta"
        if name == "llama":
            assert model.rope.inv_freq.dtype == torch.float32 and model.rope.inv_freq.device.type == "meta"
            assert model.lm_head.weight is model.tok_emb.weight


def test_float_on_a_cpu_fp32_model_copies_nothing(tiny):
    folder, _ = tiny["gpt2"]
    model = hardway.load(folder)
    pointers = [p.data_ptr() for p in model.parameters()]
    model.float().to("cpu").cpu()
    assert [p.data_ptr() for p in model.parameters()] == pointers


def test_load_takes_device_and_dtype_by_name_and_refuses_others(tiny):
    folder, _ = tiny["llama"]
    model = hardway.load(folder, device="cpu", dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16 and isinstance(model, hardway.CausalLM)
    with pytest.raises(ValueError, match="dtype 'int8'"):
        hardway.load(folder, dtype="int8")
    with pytest.raises(ValueError, match="device 'tpu'"):
        hardway.load(folder, device="tpu")


def test_load_tokenizer_takes_what_load_takes():
    """A hub repo id (the stand-in here) or its folder: the same tokenizer."""
    from hardway.formats.hub import checkpoint

    by_id = hardway.load_tokenizer("openai-community/gpt2")
    by_folder = hardway.load_tokenizer(checkpoint("openai-community/gpt2"))
    text = "The quick brown fox"
    assert by_id.encode(text) == by_folder.encode(text) == [464, 2068, 7586, 21831]
    assert by_id.decode(by_id.encode(text)) == text
