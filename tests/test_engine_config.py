"""One frozen record of an engine's settings (EngineConfig), a request's settings checked once and frozen
(SamplingParams), and GET /stats read from the engine's last StepStats (lesson 14)."""

import dataclasses

import pytest
import torch

from hardway.engine.config import EngineConfig
from hardway.engine.engine import Engine, PrefixCachingEngine
from hardway.engine.model_runner import ModelRunner
from hardway.engine.sequence import SamplingParams
from hardway.server.app import create_app
from test_serving import tiny_llama  # noqa: F401 - the fixture: a random 2-layer Llama, context 64

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.mark.parametrize("settings, named", [
    ({"n_blocks": 0}, "n_blocks"), ({"block_size": True}, "block_size"), ({"max_batch": 2.0}, "max_batch"),
    ({"max_step_tokens": -1}, "max_step_tokens"), ({"n_sliding_blocks": 0}, "n_sliding_blocks"),
    ({"compile_sizes": (1, 0)}, "compile_sizes"), ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
])
def test_engine_config_refuses_a_bad_setting_by_name(settings, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(**settings)


def test_engine_config_is_frozen_and_normalised_once():
    config = EngineConfig(compile_sizes=[16, 1, 8, 1], kv_cache_dtype="auto")
    assert config.compile_sizes == (1, 8, 16) and config.kv_cache_dtype is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch = 4
    with pytest.raises(ValueError, match="max_batch"):  # a changed copy is checked as a new one is
        dataclasses.replace(config, max_batch=0)


def test_the_keyword_arguments_and_the_config_build_the_same_engine(tiny_llama):  # noqa: F811
    model, tokenizer = tiny_llama
    old = Engine(model, tokenizer, n_blocks=24, block_size=4, max_batch=3, max_step_tokens=20)
    new = Engine(model, tokenizer, EngineConfig(n_blocks=24, block_size=4, max_batch=3, max_step_tokens=20))
    assert old.config == new.config
    for engine in (old, new):  # each part got its fields from the one record
        assert (engine.blocks.n_blocks, engine.blocks.block_size, engine.runner.block_size) == (24, 4, 4)
        assert (engine.scheduler.max_batch, engine.scheduler.max_step_tokens) == (3, 20)
        assert engine.runner.cache.scratch_slot == 24 * 4  # the pool's slots: 24 blocks of 4
    changed = PrefixCachingEngine(model, tokenizer, dataclasses.replace(new.config, max_batch=2))  # one field changed
    assert changed.config == dataclasses.replace(new.config, max_batch=2, prefix_caching=True) and changed.scheduler.max_batch == 2
    assert changed.blocks.caches_prefixes and changed.blocks.n_blocks == 24
    assert ModelRunner(model, EngineConfig(n_blocks=8, block_size=4)).cache.scratch_slot == 8 * 4
    with pytest.raises(TypeError, match="config must be an EngineConfig"):
        Engine(model, tokenizer, 24)  # the old positional n_blocks: refused by name, not misread
    with pytest.raises(TypeError, match="not both"):  # a config and fields beside it: which one wins is unclear
        Engine(model, tokenizer, new.config, max_batch=2)
    prompt = [5, 9, 2, 7]
    assert [s.output_ids for s in old.generate([prompt], GREEDY)] == \
           [s.output_ids for s in new.generate([prompt], GREEDY)]


def test_a_pool_of_n_blocks_none_is_sized_for_the_model(tiny_llama):  # noqa: F811
    model, tokenizer = tiny_llama  # context 64: 4 blocks of 16 positions per sequence
    engine = Engine(model, tokenizer, EngineConfig(n_blocks=None, max_batch=3, block_size=16))
    assert model.max_seq_len == 64 and engine.config.n_blocks == 3 * 4 == engine.blocks.n_blocks


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", 2.5), ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0),
    ("top_p", 1.5), ("min_p", -1), ("presence_penalty", float("inf")), ("logprobs", -1), ("prompt_logprobs", True),
    ("stop", ["", "x"]), ("stop", [3]),
])
def test_sampling_params_refuse_what_the_engine_cannot_use(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams: {field} must be"):
        SamplingParams(**{field: value})


def test_sampling_params_are_frozen_and_own_their_lists():
    stop, ids = ["END"], [1, 2]
    params = SamplingParams(stop=stop, stop_token_ids=ids)
    stop.append("X")
    ids.append(3)  # the caller's lists change; the request's do not
    assert params.stop == ("END",) and params.stop_token_ids == (1, 2)
    assert SamplingParams(stop="END").stop == ("END",)  # one string, as OpenAI's `stop` may be
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.seed = 3
    assert dataclasses.replace(params, seed=3).seed == 3 and params.seed is None


def test_stats_are_the_last_steps_record_not_the_live_counters(tiny_llama):  # noqa: F811
    """GET /stats reads the StepStats the engine's thread made after its last step or abort: a count the engine
    changes afterwards, outside a step, shows only in the next record."""
    model, tokenizer = tiny_llama
    engine = PrefixCachingEngine(model, tokenizer, n_blocks=16, block_size=4, max_batch=2)
    worker = create_app(engine, "tiny").state.worker  # it keeps each step's record for /stats
    for _ in range(2):  # the second time, the prompt's full block is found in the pool
        engine.add([5, 9, 2, 7, 1, 3], GREEDY)
        while engine.has_work():
            _, last = engine.step()
            worker.record(last)  # what the engine's thread does after each step
    stats = worker.stats()
    assert worker.last_stats is last
    assert (stats["running"], stats["waiting"], stats["free_blocks"]) == (last.n_running, last.n_waiting,
                                                                          last.free_blocks) == (0, 0, 16)
    assert stats["prefix_cache_hit_tokens"] == last.total_shared_tokens == 4
    seq = engine.add([1, 2, 3, 4, 5], GREEDY)  # added, not stepped: no new record yet
    engine.scheduler.n_preemptions += 7
    assert worker.stats()["waiting"] == 0 and worker.stats()["preemptions"] == last.total_preemptions
    worker.record(engine.abort(seq))  # an abort returns a record too
    assert worker.stats()["aborted"] == 1 and worker.stats()["preemptions"] == last.total_preemptions + 7


def test_serve_no_repack_holds_the_weights_once(tiny_llama, monkeypatch):  # noqa: F811
    """`hardway serve --no-repack` sets onednn=False, and an engine so configured multiplies the model's own
    matrices: no packed copy of any weight. By default EngineConfig.for_serving decides: where it pays (CPU, fp32)."""
    import hardway.server.launch as launch
    from hardway.cli import main
    from hardway.kernels.onednn import MergedLinear, OneDNNLinear, onednn_linear_pays
    from test_long_context_memory import SMOLLM2

    seen = {}
    monkeypatch.setattr(launch, "serve", lambda *args, **kwargs: seen.update(kwargs))
    assert main(["serve", "--model", SMOLLM2, "--eager", "--no-repack"]) == 0 and seen["config"].onednn is False
    assert main(["serve", "--model", SMOLLM2, "--eager", "--device", "cpu", "--dtype", "float32"]) == 0
    assert seen["config"].onednn is onednn_linear_pays("cpu", torch.float32)
    model, tokenizer = tiny_llama
    packed = [m for m in Engine(model, tokenizer, EngineConfig(n_blocks=8, onednn=False)).runner.model.modules()
              if isinstance(m, (OneDNNLinear, MergedLinear))]
    assert packed == []
    assert any(isinstance(m, OneDNNLinear)  # the default, where oneDNN is there: the packed copy
               for m in Engine(model, tokenizer, EngineConfig(n_blocks=8, onednn=True)).runner.model.modules())
