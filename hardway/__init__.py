"""hardway: LLM inference built by hand, exported from the course notebooks.

    from hardway import SamplingConfig, forward_once, generate, load, load_tokenizer
    model = load("openai-community/gpt2")           # hub id, local folder or .gguf file; device=, dtype= optional
    out = generate(model, input_ids, max_new_tokens=50, do_sample=False)          # greedy, transformers' keywords
    out = generate(model, input_ids, max_new_tokens=50, do_sample=True, top_p=0.9)
    out = generate(model, input_ids, 50, SamplingConfig(do_sample=True, top_p=0.9))  # the same settings, one object
    logits = forward_once(model, input_ids)         # (B, T, vocab)

These six names (`__all__`) are the public API, written down with their promises in docs/api.md: a documented call
keeps working. Every model `load` returns meets one contract, `hardway.CausalLM` (lesson 06). Module paths
(`hardway.decode.generate`, `hardway.engine.scheduler`, ...) are the lessons' own code, laid out by responsibility
(docs/layout.md), and change with them.

This file is the only hand-written module: it re-exports the public API, each name imported on first use so that
`import hardway` stays cheap. Everything else in hardway/ is generated from notebooks/ by tools/export.py.
"""
import importlib

_PUBLIC = {
    "CausalLM": "hardway.loading",
    "load": "hardway.loading",
    "forward_once": "hardway.loading",
    "generate": "hardway.decode.static:fast_generate",  # lesson 08's generate, compiled by lesson 12 where it pays
    "SamplingConfig": "hardway.decode.sampling",
    "load_tokenizer": "hardway.text.tokenizer",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'hardway' has no attribute {name!r}")
    module, _, attribute = _PUBLIC[name].partition(":")
    value = getattr(importlib.import_module(module), attribute or name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
