"""Lesson 13's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers with a reason that does not give the answer away."""

import pytest
import torch

import hardway
from hardway.text.chat import ChatTemplate
from hardway.exercises.lesson_13 import (check_chatml, check_pack, check_prefill_flops,
                                         check_right_padded_next_logits)
from hardway.formats.hub import checkpoint
from exercise_solutions import load_solutions

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def solution():
    return load_solutions("13_batching_and_chat")


@pytest.fixture(scope="module")
def chat():
    return ChatTemplate.from_folder(checkpoint(SMOLLM2))


@pytest.fixture(scope="module")
def model():
    return hardway.load(checkpoint(SMOLLM2), dtype=torch.float32)


def test_check_chatml(solution, chat):
    assert check_chatml(None, chat).startswith("not attempted yet")
    assert check_chatml(solution.my_chatml, chat).startswith("right")

    def no_default_system(messages, add_generation_prompt):  # forgets SmolLM2's default system message
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def no_trailing_newline(messages, add_generation_prompt):
        return solution.my_chatml(messages, add_generation_prompt).rstrip("\n")

    verdict = check_chatml(no_default_system, chat)
    assert verdict.startswith("wrong: conversation 0") and "expected 'system\\nYou are" in verdict
    assert check_chatml(no_trailing_newline, chat).startswith("wrong: conversation 0 (add_generation_prompt=False)")


def test_check_prefill_flops(solution, model):
    assert check_prefill_flops(None).startswith("not attempted yet")
    verdict = check_prefill_flops(solution.my_prefill_flops, model)
    assert verdict.startswith("right") and "on the padding" in verdict, verdict

    def real_tokens_only(config, lengths):  # as if padding cost nothing: each prompt alone
        return sum(solution.my_prefill_flops(config, [n]) for n in lengths)

    def last_position_head(config, lengths):
        return solution.my_prefill_flops(config, lengths) - 2 * len(lengths) * (max(lengths) - 1) * \
            config.hidden_size * config.vocab_size

    def causal_half(config, lengths):  # the mask taken to skip the hidden scores
        T, H, d = max(lengths), config.num_attention_heads, config.head_dim
        return solution.my_prefill_flops(config, lengths) - config.num_hidden_layers * len(lengths) * 2 * H * 2 * d * (
            T * T - T * (T + 1) // 2)

    def kv_with_every_head(config, lengths):
        return solution.my_prefill_flops(config, lengths) + 2 * len(lengths) * max(lengths) * \
            config.num_hidden_layers * 2 * (config.num_attention_heads - config.num_key_value_heads) * \
            config.head_dim * config.hidden_size

    def multiply_adds(config, lengths):
        return solution.my_prefill_flops(config, lengths) // 2

    for wrong, words in ((real_tokens_only, "padding included"), (last_position_head, "not only the last"),
                         (causal_half, "it does not skip them"), (kv_with_every_head, "num_key_value_heads"),
                         (multiply_adds, "2 FLOPs")):
        verdict = check_prefill_flops(wrong)
        assert verdict.startswith("wrong:") and words in verdict, (wrong.__name__, verdict)


def test_check_pack(solution):
    assert check_pack(None).startswith("not attempted yet")

    def not_yet(lengths):
        raise NotImplementedError

    assert check_pack(not_yet).startswith("not attempted yet: my_pack raises NotImplementedError")
    assert check_pack(solution.my_pack).startswith("right")

    def causal_only(lengths):  # one long causal row: each prompt also reads the prompts before it
        positions, _ = solution.my_pack(lengths)
        N = sum(lengths)
        return positions, torch.ones(N, N, dtype=torch.bool).tril()

    def positions_by_column(lengths):  # the row's columns, as if it were one prompt
        _, mask = solution.my_pack(lengths)
        return torch.arange(sum(lengths)), mask

    def blocks_without_causality(lengths):  # each prompt sees all of itself, its future included
        positions, mask = solution.my_pack(lengths)
        segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        return positions, segment[:, None] == segment[None, :]

    def mask_per_prompt(lengths):  # one causal mask per prompt, not one for the row
        positions, _ = solution.my_pack(lengths)
        return positions, [torch.ones(n, n, dtype=torch.bool).tril() for n in lengths]

    verdict = check_pack(causal_only)
    assert verdict.startswith("wrong: lengths [3, 1]: prompt 1") and "another prompt" in verdict
    verdict = check_pack(positions_by_column)
    assert verdict.startswith("wrong: lengths [3, 1]: the positions differs first at index (3,)")
    assert "own prompt alone" in verdict
    verdict = check_pack(blocks_without_causality)
    assert verdict.startswith("wrong: lengths [3, 1]: prompt 0") and "do not see exactly the keys" in verdict
    assert check_pack(mask_per_prompt).startswith("wrong: lengths [3, 1]: the mask should be (4, 4)")
    for verdict in (check_pack(f) for f in (causal_only, positions_by_column, blocks_without_causality)):
        assert "tril" not in verdict and "segment" not in verdict  # the reason, not the answer


def test_check_right_padded_next_logits(solution, model):
    check = check_right_padded_next_logits
    assert check(None, model).startswith("not attempted yet")
    assert check(solution.my_right_padded_next_logits, model).startswith("right")

    def last_column(model, input_ids, attention_mask):  # as with left padding: the last column
        return model(input_ids)[:, -1]

    def shifted_positions(model, input_ids, attention_mask):  # pads on the left by rolling, then the last column
        rolled = torch.stack([row.roll(int((m == 0).sum())) for row, m in zip(input_ids, attention_mask)])
        return model(rolled)[:, -1]  # the filler, now in front, is attended to and shifts the positions

    def first_token(model, input_ids, attention_mask):
        return model(input_ids)[:, 0]

    verdict = check(last_column, model)
    assert verdict.startswith("wrong: row 1 (1 real tokens of 5)") and "a padding column" in verdict
    assert "Which column" in verdict and "sum" not in verdict
    assert check(shifted_positions, model).startswith("wrong: row 1")
    verdict = check(first_token, model)
    assert verdict.startswith("wrong: row 0") and "padding column" not in verdict
    assert check(lambda m, i, a: model(i)[:, -1, :10], model).startswith("wrong: expected one row of logits per prompt")
