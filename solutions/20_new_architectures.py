"""Reference solutions to lesson 20's exercises (notebooks/20_new_architectures.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""
import torch

from hardway.verify.ritual import first_divergent_layer, hidden_state_diffs

# Exercise 1: the planted mistake. Found with the diagnostics (diagnose below), then written down.
my_diagnosis = {"layer": 1, "part": "mlp_norm"}

# transformers' name for each part of our Gemma3Block
THEIR_PART = {"attn_norm": "input_layernorm", "attn": "self_attn", "post_attn_norm": "post_attention_layernorm",
              "mlp_norm": "pre_feedforward_layernorm", "mlp": "mlp", "post_mlp_norm": "post_feedforward_layernorm"}


def diagnose(suspect, reference, input_ids, tol=1e-4):
    """The first divergent layer (lesson 11), then inside it the first part whose output differs from
    transformers' when both get transformers' input to that part."""
    layer = first_divergent_layer(hidden_state_diffs(suspect, reference, input_ids).relative, tol)
    ours, theirs = suspect.blocks[layer], reference.model.layers[layer]
    for part, their_part in THEIR_PART.items():
        seen = {}

        def keep(name):
            def hook(module, args, kwargs, output):
                seen[name] = (args, kwargs, output[0] if isinstance(output, tuple) else output)
            return hook

        handle = getattr(theirs, their_part).register_forward_hook(keep("theirs"), with_kwargs=True)
        with torch.inference_mode():
            reference(input_ids)
        handle.remove()
        args, kwargs, expected = seen["theirs"]
        with torch.inference_mode():
            if part == "attn":  # ours takes (x, cos, sin): run it at the layer's rotation
                kind = suspect.config.layer_types[layer]
                cos, sin = suspect.rotations(torch.arange(input_ids.shape[1]), kwargs["hidden_states"].dtype)[kind]
                got = getattr(ours, part)(kwargs["hidden_states"], cos, sin)
            else:
                got = getattr(ours, part)(args[0])
        if (got - expected).abs().max() > tol * expected.abs().max():
            return {"layer": layer, "part": part}
    return {"layer": layer, "part": None}


# Exercise 2: the KV cache with and without the window.
def my_kv_cache_bytes(config, n_positions, bytes_per_value):
    n_layers = config["num_hidden_layers"]
    layer_types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % config.get("sliding_window_pattern", 6) else "full_attention"
        for i in range(n_layers)]
    per_position = 2 * config["num_key_value_heads"] * config["head_dim"] * bytes_per_value  # a key and a value
    every = per_position * n_positions * n_layers
    # A sliding layer's query reads its own key and the W - 1 before it: W slots, or fewer while the sequence is short.
    windowed = sum(per_position * (min(config["sliding_window"], n_positions) if t == "sliding_attention"
                                   else n_positions) for t in layer_types)
    return every, windowed


# Exercise 3: the bytes of weights a decoded token reads: every parameter of the model once. The attention is
# n_heads x head_dim wide, which need not be hidden_size (270M: 4 x 256 = 1024 against 640); k and v have the KV heads;
# a block has four norms of hidden_size and q_norm, k_norm of head_dim; the MLP three matrices; a tied head is the
# table itself.
def my_weight_bytes(config, bytes_per_value):
    C, L, V, I = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"], config["intermediate_size"]
    n, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    attention = 2 * n * d * C + 2 * kv * d * C + 2 * d  # q, o; k, v; q_norm, k_norm
    if config.get("attention_bias", False):
        attention += n * d + 2 * kv * d + C
    block = attention + 4 * C + 3 * C * I
    head = 0 if config.get("tie_word_embeddings", True) else V * C
    return bytes_per_value * (V * C + head + L * block + C)
