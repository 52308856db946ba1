"""Qwen3.5's hybrid model (Gated DeltaNet layers and gated attention, 3:1), side by side in one run: decode speed of
hardway against llama.cpp on the same weights, decode speed after a short and a long context, and the bytes of cache
a sequence holds against a pure-attention model of the same size.

    uv run python benchmarks/qwen35.py --make-checkpoint DIR          # the benchmark's checkpoint (random weights)
    uv run python benchmarks/qwen35.py --checkpoint DIR --llama-bench avx512=PEER/build-native/bin/llama-bench \\
        --llama-bench avx2=PEER/build-avx2/bin/llama-bench --gguf PEER/qwen35-f32.gguf --transformers
    uv run python benchmarks/qwen35.py --cache-only                   # part 3 alone: arithmetic, no model

The checkpoint (`--make-checkpoint`): transformers' Qwen3_5ForCausalLM with the text shape of the smallest Qwen3.5
(0.8B: 24 layers 1024 wide, 18 Gated DeltaNet layers and 6 gated-attention layers, 248,320-token vocabulary, tied
head; 752M parameters, 3.0 GB in fp32), seeded random weights, and GPT-2's tokenizer from the stand-ins (its 50,257
tokens; the ids above them are never produced). Random weights decode at the real model's speed: the work of a token
depends on the shapes, not the values. `--gguf`: the same folder converted by llama.cpp's `convert_hf_to_gguf.py`
(F32, docs/performance.md says how).

1. Decode speed: `--new-tokens` greedy tokens after a prompt of each `--contexts` length (the course's English text),
   the prompt prefilled once, untimed; every timed run starts from a copy of the cache as the prefill left it.
   hardway runs `hardway.load`'s model with the fastest step that runs it (the compiled static step of lesson 12 where
   it takes the model, else lesson 08's eager steps: the run says which); `--transformers` adds transformers'
   model, whose greedy tokens hardway's must equal; llama.cpp runs `llama-bench -p 0 -n N -d CONTEXT -t THREADS` on
   the GGUF (text generation after a context of that depth, after its own warm-up), once per round. Rounds interleave
   the engines; the first warms up torch's (not timed); medians. The read bandwidth (a 1 GiB sum) is sampled in the
   same rounds, for the roofline.
2. Context: each engine's speed after the longest context over its speed after the shortest. A Gated DeltaNet layer
   reads a fixed-size state whatever the context; only the attention layers (1 in 4) read a cache that grows.
3. Cache bytes per sequence against context length: the attention layers' keys and values plus the Gated DeltaNet
   layers' convolution and recurrent state, against Qwen3 with the same sizes and every layer attention. Arithmetic
   from the config, checked against the bytes hardway's cache allocates; a table, and a plot (`--plot`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hardway.formats.hub import checkpoint, shakespeare_path  # noqa: E402
from hardway.instruments.memory import weight_bytes  # noqa: E402
from hardway.instruments.roofline import roofline_tokens_per_s  # noqa: E402
from hardway.instruments.timing import timed  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# The text model of the smallest Qwen3.5 (0.8B), as transformers' Qwen3_5TextConfig spells it.
CONFIG = {
    "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
    "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": True, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "bos_token_id": 50256, "eos_token_id": 50256,  # GPT-2's <|endoftext|>: the tokenizer the folder carries
}
CACHE_CONTEXTS = [1, 64, 256, 1024, 4096, 16384, 32768, 65536, 131072, 262144]


def make_checkpoint(folder: Path) -> None:
    """CONFIG's model with transformers' seeded random initialization, saved as the hub saves a checkpoint, and
    GPT-2's real tokenizer files (from the stand-ins) beside it, spelled so that llama.cpp's converter accepts them."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    folder.mkdir(parents=True, exist_ok=True)
    config = Qwen3_5TextConfig(**{k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures")})
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(config).eval().save_pretrained(folder)
    gpt2 = checkpoint("openai-community/gpt2")
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(gpt2 / name, folder / name)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>", "model_max_length": CONFIG["max_position_embeddings"]}, indent=2) + "\n")


# --- 3. cache bytes: arithmetic from the config ------------------------------------------------------------------

def cache_bytes(config: dict, positions: int, kv_bytes: int = 4, state_bytes: int = 4) -> dict[str, int]:
    """Bytes one sequence's cache holds after `positions` tokens: {"kv": keys and values of the full-attention layers,
    "conv": the Gated DeltaNet layers' last K - 1 convolution inputs, "recurrent": their (H_v, d_k, d_v) states}.
    kv_bytes, state_bytes: bytes of one number (4 for fp32; llama.cpp keeps keys and values in f16 by default, 2, and
    the states in f32)."""
    types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    n_full, n_linear = types.count("full_attention"), types.count("linear_attention")
    kv = n_full * 2 * config["num_key_value_heads"] * config["head_dim"] * kv_bytes * positions
    if not n_linear:
        return {"kv": kv, "conv": 0, "recurrent": 0}
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim  # q, k and v go through the convolution together
    conv = n_linear * conv_dim * (config["linear_conv_kernel_dim"] - 1) * state_bytes
    recurrent = n_linear * value_dim * config["linear_key_head_dim"] * state_bytes  # H_v x d_k x d_v
    return {"kv": kv, "conv": conv, "recurrent": recurrent}


def attention_only(config: dict) -> dict:
    """The same sizes with every layer full attention: a Qwen3 of Qwen3.5's width, heads and head_dim."""
    return {**config, "model_type": "qwen3", "layer_types": ["full_attention"] * config["num_hidden_layers"]}


def crossover(config: dict) -> float:
    """The context at which the hybrid's cache and the pure-attention one hold the same bytes."""
    hybrid, dense = cache_bytes(config, 1), cache_bytes(attention_only(config), 1)
    return (hybrid["conv"] + hybrid["recurrent"]) / (dense["kv"] - hybrid["kv"])


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def cache_table(config: dict, contexts: list[int]) -> None:
    per_token = cache_bytes(config, 1)["kv"]
    state = sum(cache_bytes(config, 0).values())
    dense_per_token = cache_bytes(attention_only(config), 1)["kv"]
    types = config["layer_types"]
    print(f"cache per sequence, fp32: Qwen3.5 {per_token:,} bytes a position (its {types.count('full_attention')} "
          f"attention layers) + {state:,} bytes of state ({types.count('linear_attention')} Gated "
          f"DeltaNet layers); Qwen3, every layer attention: {dense_per_token:,} bytes a position; the same bytes at "
          f"{crossover(config):,.0f} positions")
    print("\n| context | Qwen3.5: KV (MiB) | Qwen3.5: state (MiB) | Qwen3.5: total (MiB) | Qwen3, all attention (MiB) "
          "| Qwen3.5 / Qwen3 | Qwen3.5, llama.cpp's default: f16 KV, f32 state (MiB) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for T in contexts:
        h, d = cache_bytes(config, T), cache_bytes(attention_only(config), T)
        f16 = cache_bytes(config, T, kv_bytes=2)
        print(f"| {T:,} | {mib(h['kv'])} | {mib(h['conv'] + h['recurrent'])} | {mib(sum(h.values()))} | "
              f"{mib(d['kv'])} | {sum(h.values()) / d['kv']:.2f} | {mib(sum(f16.values()))} |")


def cache_plot(config: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = sorted({*(2 ** torch.arange(0, 18.01, 0.25)).round().long().tolist(), 262144})
    hybrid = [sum(cache_bytes(config, t).values()) / 2**20 for t in T]
    dense = [cache_bytes(attention_only(config), t)["kv"] / 2**20 for t in T]
    state = sum(cache_bytes(config, 0).values()) / 2**20
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(T, dense, label="Qwen3 shape, 24 attention layers: KV grows with every position")
    ax.plot(T, hybrid, label="Qwen3.5: 6 attention layers' KV + 18 Gated DeltaNet states")
    ax.axhline(state, color="gray", ls=":", lw=1, label=f"the Gated DeltaNet state alone: {state:.1f} MiB, any context")
    x = crossover(config)
    ax.axvline(x, color="gray", ls="--", lw=1)
    ax.annotate(f"equal at {x:,.0f} positions", (x, state), textcoords="offset points", xytext=(6, 30), fontsize=8)
    ax.set_xscale("log", base=2)
    ticks = [1, 16, 256, 4096, 65536, 262144]
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
    ax.set_yscale("log")
    ax.set_xlabel("context (positions)")
    ax.set_ylabel("cache of one sequence, fp32 (MiB)")
    ax.set_title("Cache per sequence: Qwen3.5 0.8B's shape against all-attention layers")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def check_cache(model, config: dict, max_len: int) -> None:
    """The arithmetic above against the bytes hardway's own cache allocates for max_len positions."""
    cache = model.new_kv_cache(1, max_len)
    expect = cache_bytes(config, max_len)
    got = {"kv": cache.nbytes, "state": cache.state.nbytes}
    if got != {"kv": expect["kv"], "state": expect["conv"] + expect["recurrent"]}:
        raise SystemExit(f"FAIL: hardway's cache for {max_len} positions holds {got}, the arithmetic says {expect}")
    print(f"hardway's cache for {max_len:,} positions: {got['kv']:,} bytes of keys and values, {got['state']:,} of "
          f"state: the arithmetic's bytes")


# --- 1, 2. decode speed --------------------------------------------------------------------------------------------

def prompt(folder: Path, n: int) -> torch.Tensor:
    """The first n tokens of the course's English text, in the checkpoint's tokenizer -> (1, n)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(shakespeare_path().read_text(encoding="utf-8")[:200_000]).input_ids
    if len(ids) < n:
        raise SystemExit(f"the text gives {len(ids)} tokens, fewer than the context {n}")
    return torch.tensor([ids[:n]])


def cache_tensors(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor an object holds in its attributes, lists, tuples and dicts."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        return [obj]
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else \
        vars(obj).values() if hasattr(obj, "__dict__") else []
    return [t for item in items for t in cache_tensors(item, seen)]


class Snapshot:
    """A cache as a prefill left it, put back in place before each timed run: the same tensors (a compiled step
    holds their addresses) refilled, and the cache's plain numbers (a recurrent state's position) reset."""

    def __init__(self, cache):
        self.cache = cache
        self.tensors = [(t, t.clone()) for t in cache_tensors(cache)]
        holders = [cache] + ([cache.state] if getattr(cache, "state", None) is not None else [])
        self.numbers = [(obj, k, v) for obj in holders for k, v in vars(obj).items()
                        if isinstance(v, int) and not isinstance(v, bool)]

    def restore(self):
        for t, saved in self.tensors:
            t.copy_(saved)
        for obj, k, v in self.numbers:
            setattr(obj, k, v)
        return self.cache


class Hardway:
    """hardway.load's model decoding greedily, after each context prefilled once."""

    def __init__(self, model, contexts: dict[int, torch.Tensor], n: int, compiled: bool):
        from hardway.decode.generate import Decoder, prefill
        from hardway.decode.static import StaticDecodeStep

        self.model, self.n, self.states = model, n, {}
        with torch.inference_mode():
            for T, ids in contexts.items():
                decoder = StaticDecodeStep(model, max_len=T + n) if compiled else Decoder(model, 1, T + n)
                first = prefill(model, ids, decoder.kv_cache)[:, -1].argmax(-1, keepdim=True)  # (1, 1)
                self.states[T] = (decoder, Snapshot(decoder.kv_cache), first)

    def prepare(self, T):
        decoder, snapshot, _ = self.states[T]
        with torch.inference_mode():
            snapshot.restore()

    @torch.inference_mode()
    def run(self, T) -> list[int]:
        decoder, _, token = self.states[T]
        out = [int(token)]
        for i in range(self.n - 1):
            token = decoder(token, torch.tensor(T + i))[:, -1].argmax(-1, keepdim=True)  # (1, 1)
            out.append(int(token))
        return out


class Transformers:
    """transformers' Qwen3_5ForCausalLM on the same folder, greedy, its cache copied from one prefill per context."""

    def __init__(self, folder: Path, contexts: dict[int, torch.Tensor], n: int):
        import copy

        from transformers import AutoModelForCausalLM

        self.copy = copy.deepcopy
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.n, self.states, self.cache = n, {}, None
        with torch.inference_mode():
            for T, ids in contexts.items():
                out = self.model(ids, use_cache=True, logits_to_keep=1)
                self.states[T] = (out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True))  # (1, 1)

    def prepare(self, T):
        self.cache = self.copy(self.states[T][0])

    @torch.inference_mode()
    def run(self, T) -> list[int]:
        token, out = self.states[T][1], [int(self.states[T][1])]
        for _ in range(self.n - 1):
            token = self.model(token, cache=self.cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(token))
        return out


def llama_bench(binary: str, gguf: Path, contexts: list[int], n: int, threads: int) -> dict[int, float]:
    """{context: tokens/s} of one `llama-bench` run: n tokens generated after each context (-d), one repetition."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(Path(binary).parent)}
    out = subprocess.run([binary, "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(n), "-r", "1",
                          "-d", ",".join(map(str, contexts)), "-o", "json"],
                         capture_output=True, text=True, check=True, env=env).stdout
    return {int(row["n_depth"]): float(row["avg_ts"]) for row in json.loads(out[out.index("["):])}


def cpu_line() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    isa = "AVX-512" + (" with VNNI" if "avx512_vnni" in flags else "") if "avx512f" in flags else \
        "AVX2" if "avx2" in flags else "neither AVX2 nor AVX-512"
    return f"{name}, {os.cpu_count()} logical CPUs, {isa}"


def speed(args) -> None:
    torch.set_num_threads(args.threads)
    folder = args.checkpoint
    contexts = {T: prompt(folder, T) for T in args.contexts}
    n = args.new_tokens
    engines, notes = {}, []
    if not args.no_hardway:
        from hardway.loading import load

        model = load(folder)
        check_cache(model, CONFIG_OF(folder), max(args.contexts) + n)
        wbytes = weight_bytes(model)
        path = "compiled static step (lesson 12)"
        try:
            if args.eager:
                raise RuntimeError("--eager")
            engines["hardway"] = Hardway(model, contexts, n, compiled=True)
            engines["hardway"].run(min(args.contexts))  # compiles, and shows that the step takes this model
        except Exception as e:  # the compiled step may not take a model whose cache holds a state
            why = str(e).splitlines()[0][:160] if str(e) else ""
            notes.append(f"hardway's compiled step does not run this model ({type(e).__name__}: {why}); "
                         f"hardway decodes with lesson 08's eager steps")
            path = "eager steps (lesson 08)"
            engines["hardway"] = Hardway(model, contexts, n, compiled=False)
        notes.append(f"hardway: {path}")
    if args.transformers:
        engines["transformers"] = Transformers(folder, contexts, n)
        if args.no_hardway:
            wbytes = weight_bytes(engines["transformers"].model)
    benches = dict(spec.split("=", 1) if "=" in spec else ("", spec) for spec in args.llama_bench)
    if benches and not args.gguf:
        raise SystemExit("--llama-bench needs --gguf, the checkpoint converted by llama.cpp's converter")

    read_buffer = torch.ones(2**30 // 4)  # 1 GiB of fp32
    rates = {(name, T): [] for name in [*engines, *(f"llama.cpp {b}".strip() for b in benches)] for T in contexts}
    reads, tokens = [], {}
    for round_ in range(args.reps + 1):  # the first round warms up
        for T in contexts:
            for name, engine in engines.items():
                engine.prepare(T)
                seconds, tokens[name, T] = timed(lambda: engine.run(T))
                if round_:
                    rates[name, T].append(n / seconds)
        seconds, _ = timed(read_buffer.sum)
        if round_:
            reads.append(read_buffer.nbytes / seconds)
        for label, binary in benches.items() if round_ else ():  # llama-bench warms itself up
            got = llama_bench(binary, args.gguf, list(contexts), n, args.threads)
            for T in contexts:
                rates[f"llama.cpp {label}".strip(), T].append(got[T])
        print(f"{time.strftime('%H:%M:%S')} round {round_}{' (warm-up)' if not round_ else ''}: " + ", ".join(
            f"{name} @{T} {tokens_per_s:.2f}" for (name, T), r in rates.items() for tokens_per_s in r[-1:]), flush=True)
    del read_buffer

    read_bw = statistics.median(reads)
    roofline = roofline_tokens_per_s(wbytes, read_bw)
    med = {key: statistics.median(r) for key, r in rates.items()}
    short, long = min(contexts), max(contexts)
    loadavg = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\n{cpu_line()}; torch {torch.__version__}, {args.threads} threads; load average {loadavg}")
    print(f"weights {wbytes / 1e6:,.1f} MB fp32; read bandwidth (a 1 GiB sum, in the same rounds) {read_bw / 1e9:.1f} "
          f"GB/s; roofline {roofline:.2f} tok/s; {n} new tokens, {args.reps} rounds after a warm-up, medians")
    for note in notes:
        print(note)
    print("\n| engine | " + " | ".join(f"tok/s after {T:,} (weights read)" for T in contexts) +
          f" | {long:,} / {short:,} |")
    print("|---|" + "---:|" * (len(contexts) + 1))
    names = sorted({name for name, _ in rates}, key=list(dict.fromkeys(name for name, _ in rates)).index)
    for name in names:
        print(f"| {name} | " + " | ".join(f"{med[name, T]:.2f} ({med[name, T] * wbytes / 1e9:.1f} GB/s)"
                                          for T in contexts) +
              f" | {med[name, long] / med[name, short]:.2f} |")
    if "hardway" in engines:
        for b in benches:
            peer = f"llama.cpp {b}".strip()
            print(f"ratio hardway / {peer}: " + ", ".join(
                f"{med['hardway', T] / med[peer, T]:.2f}x after {T:,}" for T in contexts))
    if "hardway" in engines and "transformers" in engines:
        for T in contexts:
            print(f"ratio hardway / transformers after {T:,}: {med['hardway', T] / med['transformers', T]:.2f}x")
        wrong = [T for T in contexts if tokens["hardway", T] != tokens["transformers", T]]
        same = {T: sum(a == b for a, b in zip(tokens["hardway", T], tokens["transformers", T])) for T in contexts}
        print("greedy tokens, hardway against transformers: " +
              ", ".join(f"{same[T]}/{n} the same after {T:,}" for T in contexts))
        if wrong:
            raise SystemExit(f"FAIL: hardway's greedy tokens differ from transformers' after contexts {wrong}")


def CONFIG_OF(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make-checkpoint", type=Path, metavar="DIR", help="write the benchmark's checkpoint there")
    parser.add_argument("--checkpoint", type=Path, metavar="DIR", help="the checkpoint folder to time")
    parser.add_argument("--gguf", type=Path, help="the same checkpoint converted to GGUF (F32), for llama-bench")
    parser.add_argument("--llama-bench", metavar="[LABEL=]PATH", action="append", default=[],
                        help="llama.cpp's llama-bench, built outside the repository (several: LABEL=PATH each)")
    parser.add_argument("--transformers", action="store_true", help="also time transformers (and compare tokens)")
    parser.add_argument("--no-hardway", action="store_true", help="leave hardway out (time the others alone)")
    parser.add_argument("--eager", action="store_true", help="hardway with lesson 08's eager steps")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-only", action="store_true", help="part 3 alone: the cache arithmetic")
    parser.add_argument("--plot", type=Path, help="draw part 3 into this PNG (docs/qwen35-cache.png)")
    args = parser.parse_args(argv)
    if args.make_checkpoint:
        started = time.perf_counter()
        make_checkpoint(args.make_checkpoint)
        print(f"wrote {args.make_checkpoint} in {time.perf_counter() - started:.0f} s")
        return
    config = CONFIG_OF(args.checkpoint) if args.checkpoint else CONFIG
    cache_table(config, CACHE_CONTEXTS)
    if args.plot:
        cache_plot(config, args.plot)
        print(f"\nplot: {args.plot}")
    if args.cache_only:
        return
    if not args.checkpoint:
        raise SystemExit("--checkpoint DIR: the folder to time (--make-checkpoint DIR writes one)")
    print()
    speed(args)


if __name__ == "__main__":
    main()
