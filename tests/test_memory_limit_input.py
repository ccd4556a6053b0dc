"""How a memory limit is read, in Python and on the command line: a float above 1 that is a whole
number is bytes (``40e9``); infinity, NaN, zero or less and a float above 1 with a fractional part
are one-line errors naming the option, never an OverflowError or a traceback. The examples take
``arguments.memory_limit`` as their flag's type."""

import argparse
import math

import numpy as np
import pytest
import torch

from thunder_memopt import MemoryOptimization, arguments


@pytest.mark.parametrize("limit, bytes_", [
    (40e9, 40_000_000_000), (1e10, 10_000_000_000), (2.0, 2), (np.float64(4e9), 4_000_000_000),
    (np.int64(1 << 30), 1 << 30), (123, 123),
])
def test_whole_numbers_of_bytes_are_bytes_as_an_int(limit, bytes_):
    kept = MemoryOptimization(memory_limit=limit).memory_limit
    assert kept == bytes_ and type(kept) is int


@pytest.mark.parametrize("limit, says", [
    (math.inf, "memory_limit must be a finite number above 0, got inf"),
    (-math.inf, "memory_limit must be a finite number above 0, got -inf"),
    (math.nan, "memory_limit must be a finite number above 0, got nan"),
    (-2.0, "memory_limit must be a finite number above 0, got -2.0"),
    (1.5, "memory_limit=1.5 is neither a fraction of the device's memory (in (0, 1]) nor a whole number of bytes"),
    (40e9 + 0.5, "nor a whole number of bytes"),
])
def test_infinite_and_fractional_limits_are_one_line_value_errors(limit, says):
    with pytest.raises(ValueError) as error:
        MemoryOptimization(memory_limit=limit)
    assert says in str(error.value) and "\n" not in str(error.value)


def test_a_fraction_stays_a_fraction(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for limit in (0.5, 1.0, np.float32(0.25)):
        kept = MemoryOptimization(memory_limit=limit).memory_limit
        assert kept == float(limit) and type(kept) is float


@pytest.mark.parametrize("text, value", [("1e10", 10_000_000_000), ("40e9", 40_000_000_000),
                                         ("0.5KiB", 512), ("40GiB", 40 << 30)])
def test_the_command_line_reads_whole_numbers_as_bytes(text, value):
    read = arguments.memory_limit(text)
    assert read == value and type(read) is int


@pytest.mark.parametrize("text, says", [
    ("inf", "memory_limit must be a finite number above 0, got inf"),
    ("nan", "memory_limit must be a finite number above 0, got nan"),
    ("infGiB", "'infGiB' is not a memory limit"),
    ("nanMiB", "'nanMiB' is not a memory limit"),
    ("-infGiB", "'-infGiB' is not a memory limit"),
    ("0.0001KiB", "memory_limit in bytes must be > 0, got 0"),
    ("2.5", "nor a whole number of bytes"),
])
def test_bad_limits_on_the_command_line_are_one_line_argparse_errors(text, says):
    with pytest.raises(argparse.ArgumentTypeError) as error:
        arguments.memory_limit(text)
    assert says in str(error.value) and "\n" not in str(error.value)



@pytest.mark.parametrize("states", [-1, 1.5, True, "2"])
def test_a_bad_optimizer_states_is_a_one_line_value_error(states):
    with pytest.raises(ValueError, match="optimizer_states must be an int >= 0"):
        MemoryOptimization(memory_limit=1 << 30, optimizer_states=states)
