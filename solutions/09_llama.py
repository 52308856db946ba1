"""Reference solutions to lesson 09's exercises (notebooks/09_llama.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import torch


# Exercise 1: interleaved RoPE, pairs (2i, 2i+1).
def my_rope_interleaved(x, cos, sin):
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]  # (T, d/2): pair i's angle is column i
    a, b = x[..., 0::2], x[..., 1::2]  # (B, H, T, d/2) each
    out = torch.empty_like(x)  # (B, H, T, d)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = b * c + a * s
    return out


# Exercise 2: the hub's q_proj/k_proj rows back to Meta's (interleaved) order, within each head.
def my_half_split_to_interleaved_rows(w, n_heads):
    d = w.shape[0] // n_heads
    half = torch.arange(d // 2)
    order = torch.stack((half, half + d // 2), dim=1).flatten()  # (d,): 0, d/2, 1, d/2 + 1, ...
    return w.view(n_heads, d, -1)[:, order].reshape(w.shape)


# Exercise 3: repeat_kv with expand and reshape.
def my_repeat_kv(x, n_rep):
    B, H, S, d = x.shape
    return x[:, :, None].expand(B, H, n_rep, S, d).reshape(B, H * n_rep, S, d)  # (B, H * n_rep, S, d)


# Exercise 4: the parameter count from config.json alone.
def my_parameter_count(config):
    C, H, L = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    n_head, n_kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    d = config.get("head_dim") or C // n_head
    attention_bias, mlp_bias = config.get("attention_bias", False), config.get("mlp_bias", False)
    attention = C * n_head * d + 2 * C * n_kv * d + n_head * d * C  # q, k, v, o
    if attention_bias:
        attention += n_head * d + 2 * n_kv * d + C
    mlp = 3 * C * H + (2 * H + C if mlp_bias else 0)  # gate, up, down
    per_layer = attention + mlp + 2 * C  # two RMSNorm weights
    embedding = config["vocab_size"] * C
    head = 0 if config.get("tie_word_embeddings", False) else config["vocab_size"] * C
    return embedding + L * per_layer + C + head  # + the final norm


if __name__ == "__main__":  # exercise 4's last question
    llama_3_2_1b = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True)
    print(f"Llama 3.2 1B: {my_parameter_count(llama_3_2_1b):,} parameters")
