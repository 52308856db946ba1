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


# Exercise 3: the sliding mask of a left-padded batch.
def my_sliding_batch_mask(attention_mask, window):
    S = attention_mask.shape[1]
    q = torch.arange(S)[:, None]  # (S, 1) query columns
    s = torch.arange(S)[None, :]  # (1, S) key columns
    band = (s <= q) & (q - s < window)  # (S, S): causal, and at most window - 1 columns back (padding cancels)
    real_keys = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, S)
    return band[None, None] & real_keys  # (B, 1, S, S)
