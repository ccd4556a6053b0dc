"""ThunderCompiler's per-node support check, kept where it passed.

ThunderCompiler's splitter asks of each node of each dynamo graph whether Thunder runs it
(``thunder.dynamo.utils.try_execute_thunder_symbol``): it proxies the node's arguments and traces the
symbol, with its gradient where an argument requires one. A model's layers repeat the same nodes. A check that passed is kept, keyed by all it reads (``argument_key``);
the others, failures included, run as Thunder runs them.

- ``checks_kept``: a context in which the splitter's checks are kept (``thunderfx_backend``'s compiles).
- ``keep_checks``: the same for the whole process, plain ThunderCompiler's compiles included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import thunder.dynamo.utils as dynamo_utils
import torch
import torch.fx
from thunder.dynamo.utils import _concrete_value
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["argument_key", "checks_kept", "keep_checks"]

_THUNDERS_CHECK = dynamo_utils.try_execute_thunder_symbol
_PASSED: set = set()  # the keys of the checks that passed, in this process


class _Uncacheable(Exception):
    """An argument whose check a key cannot stand for."""


def argument_key(arg: object) -> object:
    """What Thunder's check of a graph node reads of one argument (``get_proxy_inputs_from_node``): a
    tensor's shape, dtype, device and whether it requires a gradient (it proxies a new tensor of
    ones), a symbolic int's hint, and plain values as they are. Raises ``_Uncacheable`` for anything
    else (a tensor subclass that proxies with more, such as a DTensor's mesh and placements)."""
    if isinstance(arg, torch.fx.Node):
        value = arg.meta.get("example_value") if arg.op != "get_attr" else None
        values = value if isinstance(value, tuple) else (value,)
        if all(type(v) in (FakeTensor, torch.Tensor, torch.nn.Parameter) for v in values):
            tensors = tuple((_concrete_value(v.shape), v.dtype, v.device, v.requires_grad) for v in values)
            return (type(value), tensors)
        if isinstance(value, torch.SymInt) and value.node.has_hint():
            return (int, value.node.hint)
        raise _Uncacheable
    if isinstance(arg, (list, tuple)):
        return (type(arg), tuple(argument_key(a) for a in arg))
    if isinstance(arg, dict):
        return (dict, tuple((k, argument_key(v)) for k, v in arg.items()))
    if isinstance(arg, slice):
        return (slice, argument_key(arg.start), argument_key(arg.stop), argument_key(arg.step))
    if isinstance(arg, float):
        return (float, repr(arg))  # -0.0 apart from 0.0
    if arg is None or arg is Ellipsis or isinstance(arg, (bool, int, str, torch.dtype, torch.device,
                                                          torch.memory_format, torch.layout)):
        return (type(arg), arg)
    raise _Uncacheable


def _checked_once(thunder_symbol, node: torch.fx.Node, thunder_options: dict):
    """``try_execute_thunder_symbol``, answered from ``_PASSED`` where the same check passed: the
    symbol, the node's arguments (``argument_key``), ``disable_torch_autograd``, torch's default dtype
    and device, and the grad and autocast modes."""
    try:
        key = (thunder_symbol, argument_key(node.args), argument_key(node.kwargs),
               thunder_options.get("disable_torch_autograd", None), torch.get_default_dtype(),
               torch.get_default_device(), torch.is_grad_enabled(), torch._C._is_any_autocast_enabled())
        hash(key)
    except (_Uncacheable, TypeError):
        return _THUNDERS_CHECK(thunder_symbol, node, thunder_options)
    if key in _PASSED:
        return True, None
    result = _THUNDERS_CHECK(thunder_symbol, node, thunder_options)
    if result == (True, None):
        _PASSED.add(key)
    return result


@contextlib.contextmanager
def checks_kept() -> Iterator[None]:
    """Within it, the splitter's checks that passed are kept (a process that keeps them already,
    ``keep_checks``, is left so)."""
    if dynamo_utils.try_execute_thunder_symbol is not _THUNDERS_CHECK:
        yield
        return
    dynamo_utils.try_execute_thunder_symbol = _checked_once
    try:
        yield
    finally:
        dynamo_utils.try_execute_thunder_symbol = _THUNDERS_CHECK


def keep_checks() -> None:
    """Keep the splitter's checks that pass for the rest of the process."""
    dynamo_utils.try_execute_thunder_symbol = _checked_once
