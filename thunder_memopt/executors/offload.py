"""``offload_ex``: the ops that move a saved tensor to host memory in the forward and bring it back
in the backward, for the offload pass (thunder_memopt.passes.offload).

- ``memopt_offload(t) -> host``: copies ``t`` to pinned host memory on a side stream, once the
  current stream has produced it. The caller may drop ``t`` at once: a keepalive holds it until
  the copy has finished (rather than ``record_stream``, which would hold its block until whatever
  the current stream has queued by the time it is freed has run).
- ``memopt_reload(host, device) -> t``: allocates ``t`` on the current stream and fills it from
  ``host`` on the side stream, which first waits for the current stream, so that the block is no
  longer read by anything queued before. It returns at once: the copy overlaps what the current
  stream runs next.
- ``memopt_wait_reload(t) -> t``: the current stream waits for ``t``'s copy. The pass puts it just
  before ``t``'s first reader and the reload one reload earlier (a prefetch).

Pinned buffers come from torch's caching host allocator (``pin_memory=True``), a pool that reuses
freed blocks once the copies recorded on them have finished; allocating pinned memory anew would
synchronize the device. On a CPU the ops copy to a second CPU buffer, which stands in for the host
in tests: the values take the same round trip, so offloaded steps equal unoffloaded ones bit for bit.
"""

from __future__ import annotations

import collections
import functools

import torch
from thunder.core import devices, prims
from thunder.core.proxies import TensorProxy
from thunder.extend import OperatorExecutor, register_executor
from torch._prims_common import is_non_overlapping_and_dense_or_false

from thunder_memopt.core.memory import HOST_MEMORY

__all__ = ["offload_ex", "offload", "reload", "wait_reload", "host_copy_proxy"]

offload_ex = OperatorExecutor("memopt_offload")
register_executor(offload_ex)

# Sources whose copy to the host has not finished, with the event that says when it has.
_keepalive: collections.deque[tuple[torch.cuda.Event, torch.Tensor]] = collections.deque()
# Reloaded tensors (by id) -> the event of their copy, for memopt_wait_reload.
_reloading: dict[int, torch.cuda.Event] = {}


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)


def _release_copied() -> None:
    """Drop the keepalive of every source whose copy has finished, oldest first (they finish in
    order: one stream runs them)."""
    while _keepalive and _keepalive[0][0].query():
        _keepalive.popleft()


def _empty_like_dense(t: torch.Tensor, device: torch.device | str, *, pin_memory: bool = False) -> torch.Tensor:
    """An empty tensor of ``t``'s shape and dtype, with ``t``'s strides where they are dense (so a
    round trip keeps the layout the backward's kernels were compiled for), else contiguous."""
    stride = t.stride() if is_non_overlapping_and_dense_or_false(t) else torch.empty(t.shape, device="meta").stride()
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=device, pin_memory=pin_memory)


def host_copy_proxy(t: TensorProxy) -> TensorProxy:
    """A proxy for ``t``'s copy in host memory, tagged so that the memory model counts it as no
    device bytes: ``memopt_offload``'s output."""
    out = TensorProxy(like=t, device=devices.cpu, requires_grad=False)
    out.tags.add(HOST_MEMORY)
    return out


def _offload_impl(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t.clone()
    _release_copied()
    host = _empty_like_dense(t, "cpu", pin_memory=True)
    side = _side_stream(t.device)
    side.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(side):
        host.copy_(t, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(side)
    _keepalive.append((copied, t))
    return host


def _reload_meta(host: TensorProxy, device: str) -> TensorProxy:
    return TensorProxy(like=host, device=devices.to_device(device), requires_grad=False)


def _reload_impl(host: torch.Tensor, device: str) -> torch.Tensor:
    if torch.device(device).type != "cuda":
        return host.clone()
    _release_copied()
    t = _empty_like_dense(host, device)
    side = _side_stream(t.device)
    # The block may have been freed by work the current stream has not run yet; the copy to the
    # host, on this same stream, is ahead of this one already.
    side.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(side):
        t.copy_(host, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(side)
    _reloading[id(t)] = copied
    return t


def _wait_meta(t: TensorProxy) -> TensorProxy:
    return TensorProxy(like=t)


def _wait_impl(t: torch.Tensor) -> torch.Tensor:
    copied = _reloading.pop(id(t), None)
    if copied is not None:
        torch.cuda.current_stream(t.device).wait_event(copied)
    return t


# Kept where the pass puts them; core.ops names them side effects, never replayed or fused.
_TAGS = (prims.OpTags.DONT_DCE,)
offload = offload_ex.register_operator("memopt_offload", meta=host_copy_proxy, fn=_offload_impl, tags=_TAGS)
reload = offload_ex.register_operator("memopt_reload", meta=_reload_meta, fn=_reload_impl, tags=_TAGS)
wait_reload = offload_ex.register_operator("memopt_wait_reload", meta=_wait_meta, fn=_wait_impl, tags=_TAGS)
