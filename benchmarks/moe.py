"""A mixture of experts decodes at the speed of its active parameters (lesson 21), at sizes larger than the lesson's.

Three models with random weights, the same depth, width and attention: an MoE (E experts, top k, each expert H
wide, lesson 21's `MoE`), a dense Llama whose MLP is E·H wide (the same parameters in memory) and one whose MLP is
k·H wide (the same parameters per token). For each: the fp32 megabytes held, the megabytes of weights one token's
decode step reads (`active_parameters`), the median seconds of one decode step at batch 1 (lesson 10's
`decode_step_seconds`: eager steps, the prefill cancelled out) and the GB/s that implies.

    uv run python benchmarks/moe.py                          # the table in docs/performance.md
    uv run python benchmarks/moe.py --hidden 512 --expert 768 --layers 4   # the lesson's sizes

Prints a Markdown table. Weights are random: the routing is whatever the random router picks, which spreads tokens
over the experts about evenly, like a trained router's balanced load.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hardway.instruments.timing import decode_step_seconds  # noqa: E402
from hardway.models.llama import Llama, ModelConfig  # noqa: E402
from hardway.models.moe import MoE, MoEConfig, active_parameters, total_parameters  # noqa: E402


def build(hidden: int, expert: int, layers: int, experts: int, top_k: int, vocab: int) -> dict:
    """{name: model with random weights}: the MoE, the dense model of its total size, the one of its active size."""
    base = dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                max_position_embeddings=256)
    models = {
        f"MoE, {experts} experts, top {top_k}": MoE(MoEConfig.from_dict(
            {**base, "model_type": "mixtral", "intermediate_size": expert, "num_local_experts": experts,
             "num_experts_per_tok": top_k})),
        f"dense, same total (MLP {experts}H)": Llama(ModelConfig.from_dict({**base, "intermediate_size": experts * expert})),
        f"dense, same active (MLP {top_k}H)": Llama(ModelConfig.from_dict({**base, "intermediate_size": top_k * expert})),
    }
    for model in models.values():
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.05) if p.dim() > 1 else p.fill_(1.0)  # matrices random, norms' weights 1
        model.eval()
    return models


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size C (default 1024)")
    parser.add_argument("--expert", type=int, default=1536, help="one expert's hidden width H (default 1536)")
    parser.add_argument("--layers", type=int, default=4, help="blocks (default 4)")
    parser.add_argument("--experts", type=int, default=8, help="experts per block E (default 8)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token k (default 2)")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary (default 4096)")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens per timed run (default 24)")
    parser.add_argument("--reps", type=int, default=5, help="timed runs; the median is reported (default 5)")
    args = parser.parse_args(argv)

    models = build(args.hidden, args.expert, args.layers, args.experts, args.top_k, args.vocab)
    print(f"C={args.hidden}, H={args.expert}, {args.layers} blocks, vocabulary {args.vocab}, fp32, batch 1, "
          f"{torch.get_num_threads()} threads; median of {args.reps} runs of {args.new_tokens} tokens\n")
    print("| model | MB held | MB read per token | tokens/s | GB/s |")
    print("|---|---:|---:|---:|---:|")
    speeds = []
    for name, model in models.items():
        step = decode_step_seconds(model, batch_size=1, prompt_len=8, new_tokens=args.new_tokens, reps=args.reps)
        active = (active_parameters(model.config) if isinstance(model, MoE)
                  else total_parameters(model) - model.tok_emb.weight.numel())
        read, held = 4 * active, 4 * total_parameters(model)
        speeds.append(1 / step)
        print(f"| {name} | {held / 1e6:.0f} | {read / 1e6:.0f} | {1 / step:.1f} | {read / step / 1e9:.1f} |")
    print(f"\nthe MoE: {speeds[0] / speeds[1]:.2f}x the tokens/s of the dense model of its total size, "
          f"{speeds[0] / speeds[2]:.2f}x that of the dense model of its active size")


if __name__ == "__main__":
    main()
