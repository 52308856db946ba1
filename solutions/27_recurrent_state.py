"""Reference solutions to lesson 27's exercises (notebooks/27_recurrent_state.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""
import torch


# Exercise 1: decay, then read what the decayed state stores under k, then write the error where k points, then
# read the output with q from the state just written.
def my_delta_step(S, q, k, v, g, beta):
    S = S * torch.tensor(g).exp()  # (d_k, d_v): forget a little, everywhere
    error = beta * (v - k @ S)  # (d_v,): what k should return, minus what it returns now
    S = S + torch.outer(k, error)  # (d_k, d_v)
    return q @ S, S  # (d_v,), (d_k, d_v)


# Exercise 2: one cache for the whole prompt; each piece starts where the last one ended.
def my_prefill_in_pieces(model, input_ids, piece):
    cache = model.new_kv_cache(1, input_ids.shape[1])
    for start in range(0, input_ids.shape[1], piece):
        logits = model(input_ids[:, start:start + piece], kv_cache=cache, start_pos=start)  # (1, piece, V)
    return logits[:, -1]  # (1, V)


# Exercise 3: per Gated DeltaNet layer, one (d_k, d_v) matrix per value head and the conv's last K - 1 inputs of
# its 2 key_dim + value_dim channels; per position, a key and a value of each KV head in each full-attention layer.
def my_state_positions(config):
    types = config.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                          for i in range(config["num_hidden_layers"])]
    h_k, h_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    d_k, d_v = config["linear_key_head_dim"], config["linear_value_head_dim"]
    conv_dim = 2 * h_k * d_k + h_v * d_v
    state = types.count("linear_attention") * (h_v * d_k * d_v + conv_dim * (config.get("linear_conv_kernel_dim", 4) - 1))
    kv = 2 * types.count("full_attention") * config["num_key_value_heads"] * config["head_dim"]
    return state / kv
