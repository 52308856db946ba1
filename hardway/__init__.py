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

This file is the only hand-written module: it re-exports the public API, imported on first use so that
`import hardway` stays cheap (`hardway --help` imports no torch). Everything else in hardway/ is generated from
notebooks/ by tools/export.py.
"""

__all__ = ["CausalLM", "SamplingConfig", "forward_once", "generate", "load", "load_tokenizer"]


def _public_api() -> dict:
    from hardway.decode.sampling import SamplingConfig
    from hardway.decode.static import fast_generate  # lesson 08's generate, compiled by lesson 12 where it pays
    from hardway.loading import CausalLM, forward_once, load, load_tokenizer  # load_tokenizer: a .gguf's too
    return {"CausalLM": CausalLM, "SamplingConfig": SamplingConfig, "forward_once": forward_once,
            "generate": fast_generate, "load": load, "load_tokenizer": load_tokenizer}


def __getattr__(name):
    if name not in __all__:
        raise AttributeError(f"module 'hardway' has no attribute {name!r}")
    globals().update(_public_api())
    return globals()[name]


def __dir__():
    return sorted(set(globals()) | set(__all__))
