"""Lesson 06's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2LMHeadModel

import hardway
from hardway.exercises.lesson_06 import check_gpt2_param_count, check_logit_lens
from hardway.formats.hub import checkpoint
from exercise_solutions import load_solutions



def _solutions():
    return load_solutions("06_forward_pass")


@pytest.fixture(scope="module")
def folder():
    return checkpoint("openai-community/gpt2")


def test_check_gpt2_param_count(folder):
    config = json.loads((folder / "config.json").read_text())
    solution = _solutions().my_gpt2_param_count
    assert check_gpt2_param_count(None, config).startswith("not attempted yet")
    assert check_gpt2_param_count(solution, config).startswith("right")

    def head_counted_twice(cfg):
        return solution(cfg) + cfg["vocab_size"] * cfg["n_embd"]

    def no_biases(cfg):
        C, inner = cfg["n_embd"], cfg.get("n_inner") or 4 * cfg["n_embd"]
        return solution(cfg) - cfg["n_layer"] * (3 * C + C + inner + C + 2 * C) - C

    def no_wpe(cfg):
        return solution(cfg) - cfg["n_positions"] * cfg["n_embd"]

    def ignores_n_inner(cfg):
        return solution({k: v for k, v in cfg.items() if k != "n_inner"})

    assert "count it once" in check_gpt2_param_count(head_counted_twice, config)
    assert check_gpt2_param_count(no_biases, config).startswith("wrong: this checkpoint's config")
    assert check_gpt2_param_count(no_wpe, config).startswith("wrong: this checkpoint's config")
    assert check_gpt2_param_count(ignores_n_inner, config).startswith("wrong: a config with n_inner")


def test_check_logit_lens(folder):
    model = hardway.load(folder)
    reference = GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32).eval()
    solution = _solutions().my_logit_lens
    assert check_logit_lens(None, model, reference).startswith("not attempted yet")
    assert check_logit_lens(solution, model, reference).startswith("right")

    def no_final_norm(model, ids, layer):
        x = model.embed(ids)
        for block in model.blocks[:layer]:
            x = block(x)
        return F.linear(x, model.wte.weight)

    def one_block_too_many(model, ids, layer):
        return solution(model, ids, min(layer + 1, len(model.blocks)))

    assert check_logit_lens(no_final_norm, model, reference).startswith("wrong: the logits at layer 0")
    assert check_logit_lens(one_block_too_many, model, reference).startswith("wrong: the logits at layer 0")
