"""hardway: LLM inference built by hand, exported from the course notebooks.

    from hardway import SamplingConfig, generate, forward_once, load
    model = load("openai-community/gpt2")           # hub id or local folder; device=, dtype= optional
    out = generate(model, input_ids, max_new_tokens=50)                  # greedy
    out = generate(model, input_ids, 50, SamplingConfig(do_sample=True, top_p=0.9))
    logits = forward_once(model, input_ids)         # (B, T, vocab)

Every model `load` returns meets one contract, `hardway.CausalLM` (lesson 06): config, max_seq_len, eos_token_ids,
new_kv_cache(batch_size, max_len=None), forward(input_ids, kv_cache=None, start_pos=0, last_only=False,
attention_mask=None), and the diagnostics' embed, blocks, final_norm, qkv. `hardway.loading.MODEL_CLASSES` lists the architectures.

This file is the only hand-written module: it re-exports the public API, each name imported on first use so that
`import hardway` stays cheap. Everything else in hardway/ is generated from notebooks/ by tools/export.py.
"""
import importlib

_PUBLIC = {
    "CausalLM": "hardway.loading",
    "load": "hardway.loading",
    "forward_once": "hardway.loading",
    "generate": "hardway.generation",
    "SamplingConfig": "hardway.sampling",
    "load_tokenizer": "hardway.tokenizer",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'hardway' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value
