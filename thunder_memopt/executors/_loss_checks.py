"""The checks of ``linear_cross_entropy``'s options and targets, before any chunk is computed.

Options: a wrong type is a TypeError and a wrong value a ValueError, each one line naming the
option; numpy's scalars are numbers like Python's (``numbers.Real``, ``operator.index``), bools
are not. Targets: what ``torch.nn.functional.cross_entropy`` rejects is rejected with its exception
type, so that the fused head can stand in for it.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import NamedTuple

import torch

__all__ = ["LossOptions", "checked_options", "check_targets", "REDUCTIONS"]

REDUCTIONS = ("mean", "sum")
_NAME = "linear_cross_entropy"


class LossOptions(NamedTuple):
    """The options as the chunked loss takes them: Python numbers, ``softcap`` None for no cap."""

    ignore_index: int
    reduction: str
    softcap: float | None
    chunk_size: int | None


def _integer(name: str, value: object) -> int:
    """``value`` as an int (any integral number but a bool), else a TypeError naming ``name``."""
    if isinstance(value, bool):
        raise TypeError(f"{_NAME}: {name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{_NAME}: {name} must be an int, got {value!r}") from None


def _softcap(value: object) -> float | None:
    """None or a number > 0; infinity caps nothing (c * tanh(x / c) tends to x), so it is None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{_NAME}: softcap must be None or a number > 0, got {value!r}")
    softcap = float(value)
    if not softcap > 0:  # NaN too
        raise ValueError(f"{_NAME}: softcap must be None or a number > 0, got {value!r}")
    return None if math.isinf(softcap) else softcap


def checked_options(ignore_index: object, reduction: object, softcap: object, chunk_size: object,
                    gradients_in_forward: object) -> LossOptions:
    """The options, checked and normalised (see the module docstring)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{_NAME}: reduction must be one of {list(REDUCTIONS)}, got {reduction!r}")
    chunk = None if chunk_size is None else _integer("chunk_size", chunk_size)
    if chunk is not None and chunk < 1:
        raise ValueError(f"{_NAME}: chunk_size must be None or an int >= 1, got {chunk_size!r}")
    if not isinstance(gradients_in_forward, bool):
        raise TypeError(f"{_NAME}: gradients_in_forward must be True or False, got {gradients_in_forward!r}")
    return LossOptions(_integer("ignore_index", ignore_index), reduction, _softcap(softcap), chunk)


def check_targets(targets: torch.Tensor, classes: int, ignore_index: int) -> None:
    """Class indices as ``cross_entropy`` takes them: an integer dtype (a RuntimeError for bool and
    floating targets, as its), each in [0, classes) or ``ignore_index`` (an IndexError in its words).

    The range is checked on the CPU only: on CUDA the check would wait for the device on every
    step, and there, as in ``cross_entropy``'s kernel, the gather of the target's logit asserts."""
    if targets.dtype == torch.bool or targets.dtype.is_floating_point or targets.dtype.is_complex:
        raise RuntimeError(f"{_NAME}: targets must be class indices of an integer dtype, got {targets.dtype}")
    if targets.device.type != "cpu":
        return
    out_of_range = (targets != ignore_index) & ((targets < 0) | (targets >= classes))
    if out_of_range.any():
        raise IndexError(f"Target {targets[out_of_range][0].item()} is out of bounds.")
