"""Perplexity past the trained length: a model with no RoPE scaling against each scaling of lesson 23 (lesson 23).

    uv run python benchmarks/long_context_ppl.py                                   # SmolLM2-135M, 12288 tokens
    uv run python benchmarks/long_context_ppl.py --length 16384 --factor 4 --types none yarn dynamic
    uv run python benchmarks/long_context_ppl.py --length 1024 --trained 512       # a quick run, trained length pretended

One window of `--length` tokens of Python's language reference (`pydoc_data.topics`, shipped with Python) is read
once per scaling, whole, and the loss of every next token is kept. The perplexity is reported twice: over the
positions inside the trained length (the config's max_position_embeddings, or `--trained`) and over those past it.
Each scaling stretches the trained length by `--factor`; "none" is the model as published, run past its length.
LongRoPE is left out: its factors come from a search on the model, and there are none for most models. The logits
are computed 1024 positions at a time from the final hidden states (the whole (T, vocab) matrix would be gigabytes).
It prints a table in Markdown, ready for docs/long-context.md, and the seconds each pass took.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hardway.formats.hub import checkpoint  # noqa: E402
from hardway.loading import load  # noqa: E402
from hardway.models.llama import RotaryEmbedding  # noqa: E402
from hardway.models.rope_scaling import rope_scaling_from  # noqa: E402
from hardway.text.tokenizer import load_tokenizer  # noqa: E402

TYPES = ("none", "linear", "dynamic", "yarn", "llama3")


def scaling_for(rope_type: str, factor: float, trained: int, head_dim: int) -> dict | None:
    """The rope_scaling (as lesson 09's ModelConfig holds it) that stretches `trained` positions `factor` times."""
    rope = {"none": {"rope_type": "default"}, "linear": {"rope_type": "linear", "factor": factor},
            "dynamic": {"rope_type": "dynamic", "factor": factor},
            "yarn": {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": trained},
            "llama3": {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": trained}}[rope_type]
    return rope_scaling_from(rope, "rope_parameters", head_dim, trained)


class Stop(Exception):
    """Raised by the hook on the final norm: the hidden states are all we need from the forward pass."""


def token_nll(model, ids: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """The loss of every next token (T - 1,), fp32: the model up to its final norm, then the head chunk by chunk."""
    kept = {}

    def keep(module, args, output):
        kept["x"] = output
        raise Stop

    handle = model.final_norm.register_forward_hook(keep)
    try:
        with torch.inference_mode():
            model(ids[None])
    except Stop:
        pass
    finally:
        handle.remove()
    x = kept["x"][0, :-1]  # (T - 1, C): every position but the last predicts the next token
    targets = ids[1:]  # (T - 1,)
    with torch.inference_mode():
        return torch.cat([F.cross_entropy(model.lm_head(x[s:s + chunk]).float(), targets[s:s + chunk],
                                          reduction="none") for s in range(0, len(targets), chunk)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--length", type=int, default=12288, help="tokens in the window (default 12288)")
    parser.add_argument("--trained", type=int, default=None,
                        help="the trained length to stretch (default: the config's max_position_embeddings)")
    parser.add_argument("--factor", type=float, default=2.0, help="each scaling's stretch (default 2)")
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    parser.add_argument("--offset", type=int, default=2000, help="the window's first token in the text")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    from pydoc_data.topics import topics  # the language reference's sections, as help() prints them

    folder = checkpoint(args.model)
    model = load(folder, device=args.device, dtype=torch.float32)
    config = model.config
    trained = args.trained or config.max_position_embeddings
    text = "\n\n".join(topics[k] for k in sorted(topics))
    tokens = load_tokenizer(folder).encode(text[: 6 * (args.offset + args.length)])  # ~4 characters a token
    if len(tokens) < args.offset + args.length:
        print(f"the text holds {len(tokens)} tokens: ask for a shorter --length or --offset", file=sys.stderr)
        return 2
    ids = torch.tensor(tokens[args.offset:args.offset + args.length], device=args.device)  # (T,)
    model.config = dataclasses.replace(config, max_position_embeddings=max(args.length, config.max_position_embeddings))

    rows = []
    for rope_type in args.types:
        scaling = scaling_for(rope_type, args.factor, trained, config.head_dim)
        model.rope = RotaryEmbedding(dataclasses.replace(config, rope_scaling=scaling), device=args.device)
        t0 = time.perf_counter()
        nll = token_nll(model, ids)  # (T - 1,): nll[t] is the loss of token t + 1
        seconds = time.perf_counter() - t0
        inside, past = nll[: trained - 1], nll[trained - 1:]
        rows.append((rope_type, inside.mean().exp().item(), past.mean().exp().item() if len(past) else float("nan"),
                     seconds))
        print(f"{rope_type}: {seconds:.1f} s", file=sys.stderr, flush=True)

    print(f"\n{args.model}, one window of {args.length} tokens of pydoc_data.topics, trained length {trained}, "
          f"stretch {args.factor:g}\n")
    print(f"| scaling | perplexity, positions 1–{trained - 1} | perplexity, positions {trained}–{args.length - 1} "
          f"| seconds |")
    print("|---|---|---|---|")
    for rope_type, inside, past, seconds in rows:
        print(f"| {rope_type} | {inside:.2f} | {past:.2f} | {seconds:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
