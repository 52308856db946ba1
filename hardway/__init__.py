"""hardway: LLM inference built by hand, exported from the course notebooks.

    import hardway
    model = hardway.load("openai-community/gpt2")     # hub id or local folder; device=, dtype= optional
    out = hardway.generate(model, input_ids, max_new_tokens=50, do_sample=False)
    logits = hardway.forward_once(model, input_ids)  # (B, T, vocab)

This file is the only hand-written module: it re-exports the public API. Everything else in hardway/ is
generated from notebooks/ by tools/export.py. Importing is lazy, so `import hardway` stays cheap.
"""

_PUBLIC = {
    "load": "hardway.loading",
    "forward_once": "hardway.loading",
    "generate": "hardway.generation",
    "load_tokenizer": "hardway.tokenizer",
}
# Importing a model module registers its architecture with `load`.
_ARCHITECTURE_MODULES = ("hardway.gpt2", "hardway.llama")

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'hardway' has no attribute {name!r}")
    import importlib

    for module in _ARCHITECTURE_MODULES:
        importlib.import_module(module)
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value
