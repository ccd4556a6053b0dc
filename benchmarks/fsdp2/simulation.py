"""``--simulate-world-size N``: one process on the real device plays rank 0 of N FSDP2 ranks.

FSDP2 at world size 1 skips the all-gather's flat buffer and the reduce-scatter, and one GPU cannot
hold the full-depth models users shard over 8 to 64 GPUs. Under torch's fake process group
(``backend="fake"``), one process at world size N holds what rank 0 of N holds: each parameter's
1/N shard (rank 0's, the largest where dimension 0 does not divide by N, since FSDP2 pads the last
shards), the optimizer states of those shards, and full-size all-gather outputs and reduce-scatter
inputs. Its collectives move no data and take no time: the losses are meaningless (rows skip the
loss check) and NCCL's own buffers are not there.

The model is built on the meta device, sharded, and only then given memory (``to_empty``): rank 0's
shards with random values, as at any N no rank holds the whole model. ``TimelineRecorder`` records
where FSDP2 waits for, releases and issues its collectives on the compute stream, for the step-time
model (``step_model``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.fsdp2 import step_model
from benchmarks.fsdp2.step_model import Collective, Point, Timeline

INIT_STD = 0.02  # normal init of rank 0's weight shards; the values do not matter under the fake group


def init_fake_process_group(world_size: int) -> None:
    """This process as rank 0 of ``world_size`` under the fake backend (no peers, no data moved)."""
    dist.init_process_group(backend="fake", store=dist.HashStore(), rank=0, world_size=world_size)


def materialize_shards(module: torch.nn.Module, device: torch.device, seed: int) -> None:
    """Give the meta-built, sharded ``module`` memory on ``device``: this rank's shards only.

    Matrices (embeddings, linears) are drawn from N(0, INIT_STD); vectors are norm weights (ones) or
    biases (zeros). The rotary caches, buffers that FSDP2 does not shard, are computed again.
    """
    from litgpt import GPT
    from torch.distributed.tensor import DTensor

    module.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
            if local.ndim >= 2:
                local.normal_(0.0, INIT_STD, generator=generator)
            elif name.endswith("bias"):
                local.zero_()
            else:
                local.fill_(1.0)
        for gpt in module.modules():
            if isinstance(gpt, GPT):
                gpt.reset_parameters()  # litgpt's: the rope cache


def uneven_parameters(module: torch.nn.Module, world_size: int) -> list[str]:
    """Parameters whose dimension 0 does not divide by ``world_size``: FSDP2 pads them, so rank 0's
    shard (the one simulated) is larger than the last ranks'."""
    return [name for name, parameter in module.named_parameters() if parameter.shape[0] % world_size]


class TimelineRecorder:
    """Records, for each step run through ``step``, FSDP2's points on the compute stream and the bytes
    of its collectives (a ``step_model.Timeline``).

    Inside ``recording`` the methods of FSDP2's parameter groups that wait for, release and issue
    collectives are wrapped; FSDP2 runs them in eager code (dynamo skips its hooks), so the compiled
    graphs do not change. On CUDA a point is an event on the current stream; on CPU, where every op
    is synchronous, the host clock.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.steps: list[tuple[list[tuple[str, str, int | None, Any]], list[Collective]]] = []
        self._points: list[tuple[str, str, int | None, Any]] | None = None
        self._collectives: list[Collective] = []
        self._released: int | None = None
        self._in_backward = False

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _add(self, kind: str, unit: str = "", collective: int | None = None, mark: Any = None) -> None:
        if self._points is not None:
            self._points.append((kind, unit, collective, self._mark() if mark is None else mark))

    def _collective(self, kind: str, unit: str, tensor: torch.Tensor) -> int:
        self._collectives.append(Collective(kind, unit, tensor.numel() * tensor.element_size()))
        return len(self._collectives) - 1

    def step(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``run()``, one training step, recorded."""
        self._points, self._collectives, self._in_backward = [], [], False
        self._add(step_model.STEP_BEGIN)
        loss = run()
        self._add(step_model.STEP_END)
        self.steps.append((self._points, self._collectives))
        self._points = None
        return loss

    @contextlib.contextmanager
    def recording(self, optimizer: torch.optim.Optimizer) -> Iterator[TimelineRecorder]:
        """FSDP2's parameter groups and ``optimizer``'s step report to this recorder."""
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        recorder = self
        originals = {name: getattr(FSDPParamGroup, name)
                     for name in ("wait_for_unshard", "pre_forward", "post_forward", "pre_backward", "post_backward")}

        def unit(group: FSDPParamGroup) -> str:
            return group._module_fqn

        def wait_for_unshard(group: FSDPParamGroup) -> None:
            result = group._all_gather_result
            if result is not None and recorder._points is not None:
                index = recorder._collective(step_model.ALL_GATHER, unit(group), result.all_gather_output)
                recorder._add(step_model.ALL_GATHER_WAIT, unit(group), index)
                recorder._released = index
            originals["wait_for_unshard"](group)

        def pre_forward(group: FSDPParamGroup, *args: Any) -> Any:
            recorder._released = None
            out = originals["pre_forward"](group, *args)
            recorder._add(step_model.FORWARD_BEGIN, unit(group), recorder._released)
            return out

        def post_forward(group: FSDPParamGroup, *args: Any) -> Any:
            recorder._add(step_model.FORWARD_END, unit(group))
            return originals["post_forward"](group, *args)

        def pre_backward(group: FSDPParamGroup, *args: Any) -> Any:
            if group._training_state == TrainingState.PRE_BACKWARD:  # once per unit and backward
                return originals["pre_backward"](group, *args)
            if not recorder._in_backward:
                recorder._in_backward = True
                recorder._add(step_model.BACKWARD_PASS)
            recorder._released = None
            out = originals["pre_backward"](group, *args)
            recorder._add(step_model.BACKWARD_BEGIN, unit(group), recorder._released)
            return out

        def post_backward(group: FSDPParamGroup, *args: Any) -> Any:
            mark = recorder._mark()
            before = group.comm_ctx.reduce_scatter_state
            out = originals["post_backward"](group, *args)
            after = group.comm_ctx.reduce_scatter_state
            index = None
            if after is not None and after is not before and recorder._points is not None:
                index = recorder._collective(step_model.REDUCE_SCATTER, unit(group), after.reduce_scatter_input)
            recorder._add(step_model.BACKWARD_END, unit(group), index, mark)
            return out

        wrappers = {"wait_for_unshard": wait_for_unshard, "pre_forward": pre_forward, "post_forward": post_forward,
                    "pre_backward": pre_backward, "post_backward": post_backward}
        hook = optimizer.register_step_pre_hook(lambda *_: recorder._add(step_model.OPTIMIZER_BEGIN))
        for name, wrapper in wrappers.items():
            setattr(FSDPParamGroup, name, wrapper)
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(FSDPParamGroup, name, original)
            hook.remove()

    def timelines(self) -> list[Timeline]:
        """Every recorded step, its points in ms from the step's start."""
        if self.cuda:
            torch.cuda.synchronize()
        timelines = []
        for points, collectives in self.steps:
            start = points[0][3]
            timelines.append(Timeline(tuple(Point(kind, unit, index, self._elapsed_ms(start, mark))
                                            for kind, unit, index, mark in points), tuple(collectives)))
        return timelines

    def _elapsed_ms(self, start: Any, mark: Any) -> float:
        return start.elapsed_time(mark) if self.cuda else (mark - start) * 1e3


def median_timeline(timelines: list[Timeline]) -> Timeline:
    """The step whose measured compute is the median (the upper one of an even count)."""
    return sorted(timelines, key=lambda timeline: timeline.compute_ms)[len(timelines) // 2]
