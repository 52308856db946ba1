"""Reference solutions to lesson 10's exercises (notebooks/10_llama_gpu.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import torch


def _head_dim(cfg):
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


# Exercise 1: a Llama's parameters from config.json.
def my_llama_param_count(cfg):
    V, C, I, L = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    H, KV, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], _head_dim(cfg)
    attention = C * H * d + 2 * C * KV * d + H * d * C  # q_proj, k_proj, v_proj (KV heads only), o_proj
    mlp = 3 * C * I  # gate_proj, up_proj, down_proj
    block = attention + mlp + 2 * C  # + input_layernorm and post_attention_layernorm (weights only)
    embeddings = V * C * (1 if cfg.get("tie_word_embeddings", False) else 2)  # embed_tokens, and lm_head unless tied (LlamaConfig: untied by default)
    return embeddings + L * block + C  # + the final norm


# Exercise 2: keys and values, per layer, per KV head, per position, per sequence.
def my_kv_cache_bytes(cfg, batch_size, seq_len, dtype):
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg["num_hidden_layers"] * batch_size * cfg["num_key_value_heads"] * seq_len * _head_dim(cfg) * element
