"""``offload_ex``: the ops that move a saved tensor to host memory in the forward and bring it back
in the backward, for the offload pass (thunder_memopt.passes.offload).

- ``memopt_offload(t, reload_rank, opens_group) -> host``: copies ``t`` to pinned host memory on a
  side stream, once the current stream has produced it. The caller may drop ``t`` at once: a
  keepalive holds it. ``reload_rank`` is its place in its backward's order of reloads, and the
  first copy of each forward call opens a group: the prefetch below reads both.
- ``memopt_offload_wait(host)``: the current stream waits for the copy and the keepalive lets
  ``t`` go. Its block is then free for whatever the current stream runs next, with no event to
  poll: the host runs ahead of the device, so a keepalive dropped when the copy is seen to have
  ended would hold every source of a forward into its backward; ``record_stream`` would hold the
  block until all the side stream had queued by then had run. The pass places it where the copy
  should have ended, after the tensor's last forward reader.
- ``memopt_offload_release(host)``: for a copy that is not expected to end within the forward (one
  that offload="budget" must take): no wait; the tensor's block is given back to the allocator for
  reuse once the side stream has run its copy (``record_stream``), so the compute stream never
  stands still for it and the copies queue on into the next program's forward. The pass places it
  after the tensor's last forward reader.
- ``memopt_reload(host, device) -> t``: allocates ``t`` on the current stream and fills it from
  ``host`` on the side stream, which first waits for the current stream, so that the block is no
  longer read by anything queued before. It returns at once: the copy overlaps what the current
  stream runs next.
- ``memopt_wait_reload(t) -> t``: the current stream waits for ``t``'s copy. The pass puts it just
  before ``t``'s first reader and the reload one reload earlier (a prefetch). Each reload also
  starts the next one the backward will ask for (``next_to_prefetch``: of the step in flight's
  copies, the latest forward call's first in its backward's order), so that a program whose
  backward reads a saved tensor first thing (each Block's under FSDP2) finds it on its way, started
  during the previous program's backward. A forward call begins a new step where a backward ran
  since the last one, or the last one's forward raised before it ended its copies (one neither
  waited for nor released).

``activity_recorded()`` counts the reloads and those a prefetch had started, and times, on CUDA, how
long the compute streams stand still in those two waits: what the cost model says is hidden, measured.

The bookkeeping knows a host copy by its Python object (weakly referenced), which the backward
receives unchanged only if it is not a view: Thunder's autograd function detaches saved views, so
copies are made as tensors of their own over the storage they fill.

A tensor moves with its very strides: the span of storage its elements lie in is copied, so the
backward's kernels meet the layout the forward made, and an expanded tensor moves only what it
expands. Pinned buffers come from torch's caching host allocator (``pin_memory=True``), a pool that reuses
freed blocks once the copies recorded on them have finished; allocating pinned memory anew would
synchronize the device. On a CPU the ops copy at once to a second CPU buffer, which stands in for the
host in tests, with the same groups and prefetches: the values take the same round trip, so
offloaded steps equal unoffloaded ones bit for bit.

Pinned memory cannot be swapped out, and the ranks of a node share its host: pinned without bound
it would make the host swap everything else or kill the process. So each copy is checked, as it is
made, against the process's host limit (``set_host_memory_limit``, MemoryOptimization's
``host_memory_limit``): the host copies offload holds now, each as the caching host allocator
rounds it (up to a power of two), plus this one. A copy past the limit is not made: the tensor
stays on the device, ``memopt_offload`` returns it as its own "host copy" and ``memopt_reload``
returns it as it is, so the values are the same bits either way. The first reload after forwards
that kept tensors warns, once per process, with the bytes kept and the limit to raise. The check is
made here, at run time, and not in the plan: only the step knows how many programs' copies are
alive together (a Block's program runs once per Block under FSDP2) and what the host has.

The bookkeeping never outlives the tensors it is about: each host copy (and each tensor kept on
the device) has a finalizer that drops its entries when it dies, and each reloaded tensor one that
drops its pending wait. A step that raises (a CUDA out-of-memory error in its forward or its
backward) leaves copies that are never waited for or reloaded; once its graph is dropped, they die,
their sources and reloads are handed to the side stream (``record_stream``), whose queued copies
may still use them, and ``offload_state()`` is empty again: nothing stays pinned or held, and the
next step runs as a fresh one does. While its graph is kept (its exception held, or
``sys.last_traceback``), its copies stay pinned, but the next step prefetches none of them, and
drops a prefetch of theirs still pending at its first forward call: it would never be asked for, and
as the one prefetch ahead it would stop all others.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import numbers
import os
import warnings
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
from thunder.core import devices, prims
from thunder.core.proxies import TensorProxy
from thunder.extend import OperatorExecutor, register_executor

from thunder_memopt.core.memory import HOST_MEMORY

__all__ = ["offload_ex", "offload", "offload_wait", "offload_release", "reload", "wait_reload", "host_copy_proxy",
           "next_to_prefetch", "activity_recorded", "OffloadActivity", "WAIT_KINDS", "HostMemoryLimit",
           "AUTO_HOST_FRACTION", "check_host_memory_limit", "set_host_memory_limit", "host_memory_limit",
           "pinned_block_bytes", "offload_state", "OffloadState"]

offload_ex = OperatorExecutor("memopt_offload")
register_executor(offload_ex)

# Host copies (by id) -> the event of their copy and its source, kept alive until memopt_offload_wait.
_copying: dict[int, tuple[torch.cuda.Event, torch.Tensor]] = {}
# Reloaded tensors (by id) -> the event of their copy, for memopt_wait_reload, and an alias of their
# storage, which a reload that is never waited for hands to the side stream (``_forget_reload``).
_reloading: dict[int, tuple[torch.cuda.Event, torch.Tensor]] = {}
# Tensors kept on the device past the host limit (by id): a weak reference and their bytes.
_kept: dict[int, tuple[weakref.ref, int]] = {}


class _Offloaded(NamedTuple):
    """A host copy not reloaded yet."""

    ref: weakref.ref  # to the host copy
    device: str  # where it is reloaded
    group: int  # the forward call that made it (one per call, increasing)
    rank: int  # its place in its backward's order of reloads (0: reloaded first)


# Host copies not reloaded yet, by id.
_offloaded: dict[int, _Offloaded] = {}
_groups = itertools.count(1)


@dataclass
class _Step:
    """The step in flight: the forward calls from ``first_group`` on (``_open_group``)."""

    first_group: int = 0
    group: int = 0  # the latest forward call's
    unended: int = 0  # that call's copies neither waited for nor released yet
    reloaded: bool = False  # a reload has run since that call began


_step = _Step()

# The reload started ahead of its call (by the host copy's id): the copy's weak reference, which
# tells a live copy from a new one at a reused id, the reloaded tensor and its event (None on a CPU).
_prefetched: dict[int, tuple[weakref.ref, torch.Tensor, torch.cuda.Event | None]] = {}


HostMemoryLimit = int | Literal["auto"]
# "auto": this share of the host's available memory, over the ranks that share the host. Half,
# because torch's caching host allocator keeps freed blocks pinned and reuses them only for copies
# of their power-of-two size: a step at another shape (a smaller T after an out-of-memory error)
# pins blocks of new sizes while the old ones stay cached, and the other half is left to the rest
# of the node (data loading, checkpoint staging, the page cache), which pinned memory cannot yield to.
AUTO_HOST_FRACTION = 0.5


@dataclass
class _HostLimit:
    asked: HostMemoryLimit = "auto"
    limit: int | None = None  # in bytes, resolved at the first copy after ``asked`` is set
    pinned: int = 0  # the host copies alive, as the caching host allocator rounds them
    warned: bool = False  # of tensors kept on the device past the limit, once per process


_host = _HostLimit()


def check_host_memory_limit(value: object) -> None:
    """A ``host_memory_limit``: bytes (an int > 0) or "auto"; a one-line TypeError or ValueError
    otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral | str):
        raise TypeError(f"host_memory_limit must be bytes (an int > 0) or 'auto', got {value!r}")
    if isinstance(value, str) and value != "auto":
        raise ValueError(f"host_memory_limit must be bytes (an int > 0) or 'auto', got {value!r}")
    if isinstance(value, numbers.Integral) and value <= 0:
        raise ValueError(f"host_memory_limit in bytes must be > 0, got {value}")


def set_host_memory_limit(value: HostMemoryLimit) -> None:
    """The pinned host memory offload may hold in this process, from its next copy on (the
    MemoryOptimization with offload built last sets it): bytes, or "auto", ``AUTO_HOST_FRACTION``
    of the host's available memory at that copy over the ranks that share the host
    (``LOCAL_WORLD_SIZE``, set by torchrun; 1 if unset)."""
    check_host_memory_limit(value)
    _host.asked, _host.limit = value if isinstance(value, str) else int(value), None


def host_memory_limit() -> int:
    """The host limit in bytes, resolved once for "auto" (``set_host_memory_limit``)."""
    if _host.limit is None:
        if _host.asked == "auto":
            ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            _host.limit = int(AUTO_HOST_FRACTION * _available_host_bytes() / ranks)
        else:
            _host.limit = _host.asked
    return _host.limit


def _available_host_bytes() -> int:
    """What the host can give without swapping: MemAvailable of /proc/meminfo (Linux), else its
    free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class OffloadState:
    """What offload's bookkeeping holds now. Between steps, and once the graph of a step that raised
    is dropped, all of it is zero."""

    pinned_bytes: int  # the host copies alive, as the caching host allocator rounds them
    host_copies: int  # host copies not reloaded yet
    kept: int  # tensors kept on the device past the host limit, not reloaded yet
    copying: int  # sources held until their copies to the host are waited for or released
    prefetched: int  # reloads started ahead of their calls
    reloading: int  # reloads not waited for yet


def offload_state() -> OffloadState:
    return OffloadState(_host.pinned, len(_offloaded), len(_kept), len(_copying), len(_prefetched), len(_reloading))


def _forget(key: int, pinned_bytes: int) -> None:
    """A host copy (or a tensor kept on the device) of id ``key`` has died: its entries go. Normally
    it has been reloaded and waited for by then; the copies of a step that raised have not, and
    their sources and prefetched reloads go to the side stream, whose copies may still use them."""
    _host.pinned -= pinned_bytes
    _offloaded.pop(key, None)
    _kept.pop(key, None)
    copying = _copying.pop(key, None)  # only copies on a side stream (CUDA) have entries
    if copying is not None:
        _release_to_side_stream(copying[1])
    prefetched = _prefetched.pop(key, None)
    if prefetched is not None:
        _drop_prefetch(prefetched)


def _drop_prefetch(prefetched: tuple[weakref.ref, torch.Tensor, torch.cuda.Event | None]) -> None:
    """A prefetch that is never asked for: its copy, if on the side stream (an event; on a CPU it was
    made at once), may still be filling its tensor."""
    _, t, copied = prefetched
    if copied is not None:
        _release_to_side_stream(t)


def _forget_reload(key: int) -> None:
    """A reloaded tensor of id ``key`` has died: a copy into it never waited for (its step raised in
    between) may still be running, so its storage goes to the side stream."""
    reloading = _reloading.pop(key, None)
    if reloading is not None:
        _release_to_side_stream(reloading[1])


def _on_death(t: torch.Tensor, forget, *args) -> None:
    # Not at exit: CUDA may be gone by then, and so is all that the entries hold.
    weakref.finalize(t, forget, *args).atexit = False


def _release_to_side_stream(t: torch.Tensor) -> None:
    """``t``'s block goes back to the allocator only once the side stream has run what it holds."""
    t.record_stream(_side_stream(t.device))


# What a compute stream waits for: copies to the host (memopt_offload_wait) and reloads (memopt_wait_reload).
WAIT_KINDS = ("to_host", "reload")


@dataclass
class OffloadActivity:
    """What offload's ops did within ``activity_recorded()``, filled in as they run; the waits' times
    when the block ends."""

    reloads: int = 0
    prefetched: int = 0  # reloads whose copy a prefetch had started before they were asked for
    kept_bytes: int = 0  # saved bytes kept on the device: their copies would have passed the host limit
    # Milliseconds the compute streams stood still, by ``WAIT_KINDS`` (CUDA only: 0 on a CPU).
    wait_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(WAIT_KINDS, 0.0))


# Within ``activity_recorded``: what it yields, and each wait as (kind, an event before it, one after it).
_activity: OffloadActivity | None = None
_timed_waits: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []


@contextlib.contextmanager
def activity_recorded() -> Iterator[OffloadActivity]:
    """Count the reloads within the block, and time each wait of a compute stream for a copy with two
    timing events on its stream, whose interval is how long the stream stood still; the waits' sums
    by kind are added when the block ends (after waiting for the device to reach the last wait)."""
    global _activity
    activity = _activity = OffloadActivity()
    _timed_waits.clear()
    try:
        yield activity
    finally:
        _activity = None
        for kind, before, after in _timed_waits:
            after.synchronize()
            activity.wait_ms[kind] += before.elapsed_time(after)
        _timed_waits.clear()


def _wait(stream: torch.cuda.Stream, copied: torch.cuda.Event, kind: str) -> None:
    """``stream`` waits for ``copied``, timed within ``activity_recorded``."""
    if _activity is None:
        stream.wait_event(copied)
        return
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before.record(stream)
    stream.wait_event(copied)
    after.record(stream)
    _timed_waits.append((kind, before, after))


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """(storage offset, element count) of the part of its storage that ``t``'s elements lie in."""
    if t.numel() == 0:
        return t.storage_offset(), 0
    return t.storage_offset(), 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _buffer_elements(t: torch.Tensor) -> tuple[int, int]:
    """(lead, span) of ``t``'s moved buffer (``_moved``): the elements ahead of its first, which keep
    that one's alignment to the allocator's 512 bytes, some kernels choose by, and its span."""
    offset, extent = _span(t)
    return (offset * t.element_size() % 512) // t.element_size(), extent


def pinned_block_bytes(nbytes: int) -> int:
    """The pinned memory a host copy of ``nbytes`` takes: rounded up to a power of two, as torch's
    caching host allocator rounds each block."""
    return 1 << (nbytes - 1).bit_length() if nbytes else 0


def _pinned_bytes(t: torch.Tensor) -> int:
    """The pinned memory ``t``'s host copy takes: its buffer, as the allocator rounds it."""
    lead, extent = _buffer_elements(t)
    return pinned_block_bytes((lead + extent) * t.element_size())


def _moved(t: torch.Tensor, device: torch.device | str, stream: torch.cuda.Stream | None) -> torch.Tensor:
    """``t`` on ``device`` with its very strides, its span of storage copied (on ``stream`` if given,
    into pinned memory if to the host): kernels of the backward meet the layout the forward made, and
    an expanded tensor moves its small storage, not its expansion, behind the elements that keep the
    first's alignment (``_buffer_elements``). The result is no view (see the module docstring): a
    tensor of its own over the filled storage."""
    lead, extent = _buffer_elements(t)
    pinned = torch.device(device).type == "cpu" and t.is_cuda
    flat = torch.empty(lead + extent, dtype=t.dtype, device=device, pin_memory=pinned)
    source = t.as_strided((extent,), (1,), t.storage_offset())
    if stream is None:
        flat[lead:].copy_(source)
    else:
        # The wait follows the allocation: a reload's block, taken on the current stream, is then
        # ordered after it there too, not only after the work queued before it.
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            flat[lead:].copy_(source, non_blocking=True)
    return _tensor_over(flat.untyped_storage(), lead, t)


def _tensor_over(storage: torch.UntypedStorage, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A tensor with ``like``'s shape and strides over ``storage`` from ``offset``: no view, so that
    Thunder's autograd function saves it as it is (it detaches views, a new object)."""
    return torch.empty(0, dtype=like.dtype, device=storage.device).set_(storage, offset, like.shape, like.stride())


def host_copy_proxy(t: TensorProxy) -> TensorProxy:
    """A proxy for ``t``'s copy in host memory, tagged so that the memory model counts it as no
    device bytes: ``memopt_offload``'s output."""
    out = TensorProxy(like=t, device=devices.cpu, requires_grad=False)
    out.tags.add(HOST_MEMORY)
    return out


def _offload_meta(t: TensorProxy, reload_rank: int, opens_group: bool) -> TensorProxy:
    return host_copy_proxy(t)


def _open_group() -> None:
    """A forward call's first copy: its group, and a new step where a backward ran since the last
    call or the last call's forward raised. The copies made before are then not of this step (a
    failed step's kept graph): a prefetch of theirs still pending would never be asked for."""
    _step.group = next(_groups)
    if _step.unended or _step.reloaded:
        _step.first_group = _step.group
        while _prefetched:
            _drop_prefetch(_prefetched.popitem()[1])
    _step.unended, _step.reloaded = 0, False


def _offload_impl(t: torch.Tensor, reload_rank: int, opens_group: bool) -> torch.Tensor:
    if opens_group:
        _open_group()
    _step.unended += 1  # before the copy, which may raise: then the forward never ends it
    pinned = _pinned_bytes(t)
    if _host.pinned + pinned > host_memory_limit():
        # Kept on the device, as its own host copy: the reload returns it as it is.
        kept, nbytes = _tensor_over(t.untyped_storage(), t.storage_offset(), t), t.untyped_storage().nbytes()
        _kept[id(kept)] = (weakref.ref(kept), nbytes)
        _on_death(kept, _forget, id(kept), 0)
        if _activity is not None:
            _activity.kept_bytes += nbytes
        return kept
    host, copied = _copied(t, "cpu", t.device)
    _host.pinned += pinned
    _on_death(host, _forget, id(host), pinned)
    if copied is not None:
        _copying[id(host)] = (copied, t)
    _offloaded[id(host)] = _Offloaded(weakref.ref(host), str(t.device), _step.group, reload_rank)
    return host


def _offload_wait_meta(host: TensorProxy) -> None:
    return None


def _offload_wait_impl(host: torch.Tensor) -> None:
    _step.unended -= 1
    copying = _copying.pop(id(host), None)
    if copying is not None:
        copied, source = copying
        _wait(torch.cuda.current_stream(source.device), copied, "to_host")


def _offload_release_impl(host: torch.Tensor) -> None:
    _step.unended -= 1
    copying = _copying.pop(id(host), None)
    if copying is not None:
        _release_to_side_stream(copying[1])


def _reload_meta(host: TensorProxy, device: str) -> TensorProxy:
    return TensorProxy(like=host, device=devices.to_device(device), requires_grad=False)


def _copied(t: torch.Tensor, to: torch.device | str, device: torch.device
            ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``_moved(t, to)``, and the event that marks its end. Where ``device`` (the GPU of the copy) is
    a CPU, the copy is made at once (no event). On a GPU it runs on the side stream, which first
    waits for the current one (``_moved``): a copy to the host waits for its source to be made, a
    reload for its block, allocated on the current stream, to be free of the work queued there
    before. Copies to and from the host run in order on the one side stream, so a reload follows its
    copy to the host."""
    if device.type != "cuda":
        return _moved(t, to, None), None
    side = _side_stream(device)
    moved = _moved(t, to, side)
    copied = torch.cuda.Event()
    copied.record(side)
    return moved, copied


def _reload_impl(host: torch.Tensor, device: str) -> torch.Tensor:
    _step.reloaded = True
    _warn_of_kept_once()
    kept = _kept.pop(id(host), None)
    if kept is not None and kept[0]() is host:
        _prefetch_next(device)
        return host
    _offloaded.pop(id(host), None)
    prefetched = _prefetched.pop(id(host), None)
    hit = prefetched is not None and prefetched[0]() is host
    if hit:
        _, t, copied = prefetched
    else:
        t, copied = _copied(host, device, torch.device(device))
    if copied is not None:
        # Its storage under another tensor, not a view: a view would keep ``t`` alive.
        _reloading[id(t)] = (copied, _tensor_over(t.untyped_storage(), t.storage_offset(), t))
        _on_death(t, _forget_reload, id(t))
    if _activity is not None:
        _activity.reloads += 1
        _activity.prefetched += hit
    _prefetch_next(device)
    return t


def _warn_of_kept_once() -> None:
    """At a backward's first reload the forwards before it have made every copy they keep on the
    device: once per process, a warning that says how much and which limit to raise."""
    if _kept and not _host.warned:
        _host.warned = True
        kept = sum(nbytes for _, nbytes in _kept.values())
        warnings.warn(f"thunder_memopt: offload kept {_size(kept)} of saved tensors on the device: "
                      f"their copies would have taken its pinned host memory past host_memory_limit "
                      f"({_size(host_memory_limit())}); raise MemoryOptimization(host_memory_limit=...) "
                      "to offload them (warned once)")


def _size(nbytes: int) -> str:
    """MiB to one decimal, or bytes where that would read 0.0 MiB."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 // 10 else f"{nbytes} bytes"


def _prefetch_next(device: str) -> None:
    """Start the reload the backward will ask for next (``next_to_prefetch``), one ahead at most.
    (A copy whose backward never runs takes its entries with it when it dies, ``_forget``, and its
    pending prefetch goes at the next step's first forward call, ``_open_group``.)"""
    key = None if _prefetched else next_to_prefetch(_offloaded, device, _step.first_group)
    if key is not None:
        entry = _offloaded[key]
        _prefetched[key] = (entry.ref, *_copied(entry.ref(), device, torch.device(device)))


def next_to_prefetch(offloaded: Mapping[int, _Offloaded], device: str, first_group: int = 0) -> int | None:
    """Of the host copies not reloaded yet of the forward calls from ``first_group`` on (the step in
    flight's), the one a backward reloads next: programs run their backwards in the reverse order of
    their forwards (one per Block under FSDP2), so the latest forward call's, and of its copies the
    first in its backward's order. A program whose backward reads a saved tensor first thing then
    finds it on its way, started during the previous one's."""
    live = [(key, entry) for key, entry in offloaded.items()
            if entry.device == device and entry.group >= first_group and entry.ref() is not None]
    if not live:
        return None
    latest = max(entry.group for _, entry in live)
    return min((entry.rank, key) for key, entry in live if entry.group == latest)[1]


def _wait_meta(t: TensorProxy) -> TensorProxy:
    return TensorProxy(like=t)


def _wait_impl(t: torch.Tensor) -> torch.Tensor:
    reloading = _reloading.pop(id(t), None)
    if reloading is not None:
        _wait(torch.cuda.current_stream(t.device), reloading[0], "reload")
    return t


# Kept where the pass puts them; core.ops names them side effects, never replayed or fused.
_TAGS = (prims.OpTags.DONT_DCE,)
offload = offload_ex.register_operator("memopt_offload", meta=_offload_meta, fn=_offload_impl, tags=_TAGS)
offload_wait = offload_ex.register_operator("memopt_offload_wait", meta=_offload_wait_meta, fn=_offload_wait_impl,
                                            tags=_TAGS)
offload_release = offload_ex.register_operator("memopt_offload_release", meta=_offload_wait_meta,
                                               fn=_offload_release_impl, tags=_TAGS)
reload = offload_ex.register_operator("memopt_reload", meta=_reload_meta, fn=_reload_impl, tags=_TAGS)
wait_reload = offload_ex.register_operator("memopt_wait_reload", meta=_wait_meta, fn=_wait_impl, tags=_TAGS)
