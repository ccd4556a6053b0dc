"""Argument types shared by the report CLI and the benchmark: a bad value is argparse's one-line
error (exit 2) before any work starts, never a traceback from deep inside."""

from __future__ import annotations

import argparse
import difflib
import math

import torch

from thunder_memopt.models import HEAD_SIZE
from thunder_memopt.passes import fit

__all__ = [
    "positive_int",
    "non_negative_int",
    "positive_float",
    "non_negative_float",
    "fraction",
    "memory_limit",
    "litgpt_model_name",
    "narrow_width",
    "device_name",
]


def _number(text: str, kind: type[int] | type[float], in_range, requirement: str):
    """``text`` read as ``kind``, checked by ``in_range``; argparse's error, naming ``requirement``,
    where it is not a number or not in range."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not in_range(value):
        raise argparse.ArgumentTypeError(f"must be {requirement}, got {value if kind is int else format(value, 'g')}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, lambda value: value >= 1, "at least 1")


def non_negative_int(text: str) -> int:
    return _number(text, int, lambda value: value >= 0, "at least 0")


def positive_float(text: str) -> float:
    """A number above 0 (rates)."""
    return _number(text, float, lambda value: value > 0.0, "above 0")


def non_negative_float(text: str) -> float:
    """A number at least 0 (where 0 turns a limit off)."""
    return _number(text, float, lambda value: value >= 0.0, "at least 0")


def fraction(text: str) -> float:
    """A number in [0, 1] (activation budgets)."""
    return _number(text, float, lambda value: 0.0 <= value <= 1.0, "in [0, 1]")


_BINARY_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def memory_limit(text: str) -> int | float | str:
    """MemoryOptimization's ``memory_limit``: bytes (an integer, a number and KiB, MiB, GiB or TiB:
    ``40GiB``, or a number above 1 that is a whole number: ``4e10``), a fraction of the CUDA device's
    memory (a number in (0, 1] with a point: ``0.9``) or ``auto`` (``fit.checked_memory_limit``)."""
    try:
        value = _memory_value(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a memory limit (bytes: 40GiB or 4e10; a fraction: 0.9; or auto)") from None
    try:
        return fit.checked_memory_limit(value)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _memory_value(text: str) -> int | float | str:
    """``auto``; bytes with a binary unit (finite and above 0, or a ValueError); an integer as bytes;
    any other number as ``fit.checked_memory_limit`` reads a float."""
    if text == "auto":
        return text
    for name, size in _BINARY_UNITS.items():
        if text.endswith(name):
            value = float(text[:-len(name)]) * size
            if not (math.isfinite(value) and value > 0):
                raise ValueError(text)
            return int(value)
    return int(text) if text.strip().lstrip("-").isdigit() else float(text)


def litgpt_model_name(text: str) -> str:
    from litgpt.config import name_to_config

    if text in name_to_config:
        return text
    close = difflib.get_close_matches(text, list(name_to_config), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise argparse.ArgumentTypeError(f"{text!r} is not a litgpt config name{hint}")


def narrow_width(text: str) -> int:
    """A width for ``models.narrow_config``: a positive multiple of its head size."""
    value = positive_int(text)
    if value % HEAD_SIZE:
        raise argparse.ArgumentTypeError(f"must be a multiple of the head size {HEAD_SIZE}, got {value}")
    return value


def device_name(text: str) -> str:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda, cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: only cpu and cuda devices are supported")
    return text
