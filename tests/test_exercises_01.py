"""Lesson 01's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers."""

import json
from pathlib import Path

import pytest
import torch

from hardway.exercises.lesson_01 import check_corrupt_files, check_load_tensor, check_read_header
from hardway.formats.hub import checkpoint
from exercise_solutions import load_solutions



@pytest.fixture(scope="module")
def solution():
    return load_solutions("01_safetensors")


@pytest.fixture(scope="module")
def path():
    return checkpoint("openai-community/gpt2") / "model.safetensors"


def test_check_read_header(solution, path):
    assert check_read_header(None, path).startswith("not attempted yet")
    assert check_read_header(solution.my_read_header, path).startswith("right")

    def forgets_the_8_bytes(p):  # data_start = N, not 8 + N
        header, data_start = solution.my_read_header(p)
        return header, data_start - 8

    def drops_metadata(p):
        header, data_start = solution.my_read_header(p)
        return {k: v for k, v in header.items() if k != "__metadata__"}, data_start

    def four_byte_size(p):  # reads the size as a 32-bit number: the header then starts 4 bytes early
        with open(p, "rb") as f:
            n = int.from_bytes(f.read(4), "little")
            return json.loads(f.read(n)), 4 + n

    verdict = check_read_header(forgets_the_8_bytes, path)
    assert verdict.startswith("wrong:") and "data begins at byte" in verdict
    assert "__metadata__" in check_read_header(drops_metadata, path)
    assert "raised" in check_read_header(four_byte_size, path)


def test_check_load_tensor(solution, path):
    assert check_load_tensor(None, path).startswith("not attempted yet")
    assert check_load_tensor(solution.my_load_tensor, path).startswith("right")

    def off_by_8(p, name):  # seeks to N + begin: reads the last 8 header bytes and loses 8 data bytes
        header, data_start = solution.my_read_header(p)
        info = header[name]
        begin, end = info["data_offsets"]
        dtype = solution.DTYPES[info["dtype"]]
        if begin == end:
            return torch.empty(info["shape"], dtype=dtype)
        with open(p, "rb") as f:
            f.seek(data_start - 8 + begin)
            return torch.frombuffer(bytearray(f.read(end - begin)), dtype=dtype).reshape(info["shape"])

    def bf16_as_fp16(p, name):  # both are 2 bytes: the wrong one gives other numbers
        t = solution.my_load_tensor(p, name)
        return t.view(torch.float16) if t.dtype == torch.bfloat16 else t

    def flat(p, name):  # forgets the reshape
        return solution.my_load_tensor(p, name).reshape(-1)

    def no_empty_case(p, name):  # torch.frombuffer refuses an empty buffer
        header, data_start = solution.my_read_header(p)
        info = header[name]
        begin, end = info["data_offsets"]
        with open(p, "rb") as f:
            f.seek(data_start + begin)
            raw = bytearray(f.read(end - begin))
        return torch.frombuffer(raw, dtype=solution.DTYPES[info["dtype"]]).reshape(info["shape"])

    assert "values differ" in check_load_tensor(off_by_8, path)
    assert "expected dtype torch.bfloat16" in check_load_tensor(bf16_as_fp16, path)
    assert "expected shape" in check_load_tensor(flat, path)
    assert "raised" in check_load_tensor(no_empty_case, path)


def test_check_corrupt_files(solution):
    assert check_corrupt_files(None).startswith("not attempted yet")
    assert check_corrupt_files(solution.my_check_file).startswith("right")

    def accepts_everything(p):
        pass

    def rejects_everything(p):
        raise ValueError("no")

    def json_only(p):  # checks the size and the JSON, not the offsets: misses gaps, overlaps, trailing bytes
        data = Path(p).read_bytes()
        n = int.from_bytes(data[:8], "little")
        if len(data) < 8 or n > len(data) - 8 or not isinstance(json.loads(data[8:8 + n]), dict):
            raise ValueError("bad header")

    def no_tiling(p):  # checks sizes and the end of the data, not the order: a gap or an overlap goes through
        try:
            solution.my_check_file(p)
        except ValueError as e:
            if "tensor begins at" in str(e):
                return
            raise

    assert "your function accepted it" in check_corrupt_files(accepts_everything)
    assert "is valid" in check_corrupt_files(rejects_everything)
    assert "your function accepted it" in check_corrupt_files(json_only)
    verdict = check_corrupt_files(no_tiling)
    assert "gap" in verdict and "accepted" in verdict
