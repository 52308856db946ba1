"""A tiny random checkpoint saved beside SmolLM2's tokenizer files: the serving tests of lessons 28 to 31 need text in
and out, and a random model of SmolLM2's vocabulary size reads every id that tokenizer gives."""

import json

from hardway.formats.hub import checkpoint

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"  # its tokenizer: ids below 49152


def smollm2_vocab_size() -> int:
    return json.loads((checkpoint(SMOLLM2) / "config.json").read_text())["vocab_size"]


def save_with_smollm2_tokenizer(model, out):
    """model (transformers') saved to the folder `out`, with SmolLM2's tokenizer files -> out."""
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((checkpoint(SMOLLM2) / name).read_bytes())
    return out
