"""Lesson 32: what one sequence costs the engine's pool (`cache_cost`), and the pool sized from a memory budget
(`pool_for_memory`).

The costs are checked against numbers worked out by hand from the configurations, and against the engine itself: on
a tiny random Gemma 3 (five windowed layers of six), what each running sequence's block tables hold at every step,
after the window has slid, is what `CacheCost.blocks` says; a pool sized for a budget allocates no more than it, and
not a block less than fits. A tiny Qwen3.5 adds its state slots to the bill.
"""

import pytest
import torch

from hardway.engine.block_manager import FREED
from hardway.engine.cache_budget import CacheCost, cache_cost, pool_for_memory
from hardway.engine.config import EngineConfig
from hardway.engine.engine import Engine
from hardway.engine.sequence import SamplingParams
from hardway.errors import ConfigError
from test_qwen35_serving import folder, qwen35  # noqa: F401  (fixtures: a tiny Qwen3.5 and SmolLM2's tokenizer)
from test_sliding_cache import BLOCK, TOKENIZER, WINDOW, llama, prompts_of, windowed  # noqa: F401  (fixtures)


def pool_bytes(cache) -> int:
    """Every byte the engine's pool allocated: its keys and values, and state slots if it has them."""
    tensors = cache.k + cache.v + list(getattr(cache, "conv", [])) + list(getattr(cache, "recurrent", []))
    return sum(t.nbytes for t in tensors)


def test_the_costs_are_the_configurations_arithmetic(windowed, llama):
    # Gemma 3 stand-in: 1 full and 5 windowed layers, 2 KV heads of 16, fp32; the Llama: 6 full layers, 2 of 16 (64 / 4)
    assert cache_cost(windowed, BLOCK) == CacheCost(BLOCK, BLOCK * 1 * 2 * 2 * 16 * 4, BLOCK * 5 * 2 * 2 * 16 * 4,
                                                    WINDOW, 0)
    assert cache_cost(windowed, BLOCK, sliding_pool=False) == CacheCost(BLOCK, BLOCK * 6 * 2 * 2 * 16 * 4, 0, None, 0)
    assert cache_cost(llama, 16) == CacheCost(16, 16 * 6 * 2 * 2 * 16 * 4, 0, None, 0)


def test_every_running_sequence_holds_the_blocks_its_cost_says(windowed):
    """Three requests with chunked prefills beside decodes, prompts longer than the window: after each step, once
    the window has slid to the sequence's next query (as the scheduler does before the next step), its tables hold
    CacheCost.blocks(n_cached) blocks."""
    engine = Engine(windowed, TOKENIZER, n_blocks=96, block_size=BLOCK, max_batch=3, max_step_tokens=12)
    cost, sliding = cache_cost(windowed, BLOCK), engine.sliding_blocks
    for p in prompts_of((5, 23, 14)):
        engine.add(p, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[]))
    seen = set()
    while engine.has_work():
        engine.step()
        for seq in engine.running:
            sliding.slide(seq.sliding_table, seq.n_cached)
            held = (len(seq.block_table), sum(b != FREED for b in seq.sliding_table))
            assert held == cost.blocks(seq.n_cached), (seq.n_cached, held, cost.blocks(seq.n_cached))
            seen.add(seq.n_cached)
    assert max(seen) > 3 * WINDOW and min(seen) < WINDOW  # inside the window and well past it


@pytest.mark.parametrize("budget", [70_000, 200_000, 1_000_003])
def test_a_pool_sized_for_a_budget_fits_it(windowed, llama, budget):
    for model in (windowed, llama):
        config = pool_for_memory(model, budget, EngineConfig(block_size=BLOCK, max_batch=2, max_step_tokens=12))
        engine = Engine(model, TOKENIZER, config)
        used, cost = pool_bytes(engine.runner.cache), cache_cost(model, BLOCK)
        assert used <= budget < used + cost.full_block_bytes, (budget, used)


def test_state_slots_are_paid_for_first(qwen35):  # noqa: F811
    model, tokenizer = qwen35
    cost = cache_cost(model, 8)
    # 3 Gated DeltaNet layers: a (4 value heads, 16, 24) fp32 state and the conv's last 3 inputs of 2 * 2 * 16 + 4 * 24
    assert cost.state_bytes == 3 * (4 * 16 * 24 + (2 * 2 * 16 + 4 * 24) * 3) * 4
    assert cost.full_block_bytes == 8 * 1 * 2 * 2 * 32 * 4  # 1 full-attention layer, 2 KV heads of 32
    budget = 3 * cost.state_bytes + 40 * cost.full_block_bytes
    config = pool_for_memory(model, budget, EngineConfig(block_size=8, max_batch=3, max_step_tokens=16))
    assert config.n_blocks == 39  # 40 blocks' bytes, less the scratch slot
    used = pool_bytes(Engine(model, tokenizer, config).runner.cache)
    assert used <= budget < used + cost.full_block_bytes


def test_a_budget_too_small_for_one_step_is_one_line(windowed, llama):
    for model in (windowed, llama):
        with pytest.raises(ConfigError, match="cannot hold one step of 12 positions") as error:
            pool_for_memory(model, 5_000, EngineConfig(block_size=BLOCK, max_batch=2, max_step_tokens=12))
        assert "\n" not in str(error.value)


def test_the_published_sizes_cost_nothing_to_ask_about():
    """Llama 3.1 8B, built on the meta device, in bf16: 128 KiB a position, a block of 16 is 2 MiB, no memory."""
    from hardway.contract import shapes_only
    from hardway.models.llama import Llama, ModelConfig

    config = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                                    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                    "vocab_size": 128256, "max_position_embeddings": 131072})
    with shapes_only():
        model = Llama(config).to(torch.bfloat16)
    cost = cache_cost(model)
    assert cost.full_block_bytes == 16 * 131072 and cost.bytes(131072) == 16 * 2**30
