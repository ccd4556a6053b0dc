"""``--simulate-world-size``: FSDP2 at N ranks played by one process under the fake process group
(benchmarks/fsdp2/simulation.py), and the step-time model laid over its measured compute
(benchmarks/fsdp2/step_model.py).

On CPU, without gloo: rank 0's shards are 1/N of each parameter (the padded first chunk where N does
not divide), the all-gathers and reduce-scatters are over the full unsharded size, and the rows say
that they are simulated. The model is checked against timelines computed by hand.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

from benchmarks.fsdp2 import step_model  # noqa: E402
from benchmarks.fsdp2.step_model import Collective, Point, Timeline  # noqa: E402
from benchmarks.fsdp2.trial import load_rows  # noqa: E402

TIMEOUT_S = 300


def timeline(points: list[tuple], collectives: list[tuple]) -> Timeline:
    return Timeline(tuple(Point(*point) for point in points), tuple(Collective(*c) for c in collectives))


# Two units A and B under zero3 at 2 ranks and 1 GB/s: a collective of 4 MB takes 2 ms, 24 MB 12 ms.
ZERO3 = timeline(
    [("step_begin", "", None, 0.0),
     ("all_gather_wait", "A", 0, 0.0), ("forward_begin", "A", 0, 0.1), ("forward_end", "A", None, 5.0),
     ("all_gather_wait", "B", 1, 5.0), ("forward_begin", "B", 1, 5.1), ("forward_end", "B", None, 10.0),
     ("backward_pass", "", None, 10.0),
     ("all_gather_wait", "B", 2, 10.0), ("backward_begin", "B", 2, 10.2), ("backward_end", "B", 3, 20.0),
     ("all_gather_wait", "A", 4, 20.0), ("backward_begin", "A", 4, 20.2), ("backward_end", "A", 5, 30.0),
     ("optimizer_begin", "", None, 30.5), ("step_end", "", None, 35.0)],
    [("all_gather", "A", 4_000_000), ("all_gather", "B", 4_000_000), ("all_gather", "B", 4_000_000),
     ("reduce_scatter", "B", 4_000_000), ("all_gather", "A", 4_000_000), ("reduce_scatter", "A", 24_000_000)])


def test_the_model_waits_where_fsdp2_waits():
    """By hand: A's forward all-gather is exposed (2 ms); B's, started at the step's start after A's,
    is hidden behind A's forward. The first backward all-gather starts when the backward does and is
    exposed (2 ms); A's is prefetched once B's is released and hides behind B's backward. A's
    reduce-scatter (12 ms) starts at A's post-backward (modelled 34 ms) and the optimizer waits for
    it (until 46 ms): 11.5 ms more. Step: 35 + 2 + 2 + 11.5 = 50.5 ms."""
    model = step_model.model_step(ZERO3, world_size=2, bus_gbps=1.0)
    assert model.compute_ms == 35.0
    assert model.step_ms == pytest.approx(50.5)
    assert model.exposed_ms == pytest.approx(15.5)
    assert (model.all_gather_ms, model.reduce_scatter_ms) == (pytest.approx(8.0), pytest.approx(14.0))
    assert (model.all_gather_bytes, model.reduce_scatter_bytes) == (16_000_000, 28_000_000)
    assert model.fields()["sim_step_ms"] == model.step_ms and model.fields()["sim_bus_gbps"] == 1.0


def test_forward_all_gathers_run_two_ahead_of_the_compute():
    """Three 3 ms all-gathers before units of 1 ms compute each: the third may start only once the
    first is released (FSDP2's implicit prefetch keeps two in flight), and the link is the bound:
    3 x 3 ms and the last unit's 1 ms."""
    forward = timeline(
        [("step_begin", "", None, 0.0),
         ("all_gather_wait", "U0", 0, 0.0), ("forward_begin", "U0", 0, 0.0), ("forward_end", "U0", None, 1.0),
         ("all_gather_wait", "U1", 1, 1.0), ("forward_begin", "U1", 1, 1.0), ("forward_end", "U1", None, 2.0),
         ("all_gather_wait", "U2", 2, 2.0), ("forward_begin", "U2", 2, 2.0), ("forward_end", "U2", None, 3.0),
         ("step_end", "", None, 3.0)],
        [("all_gather", f"U{i}", 6_000_000) for i in range(3)])
    assert step_model.model_step(forward, world_size=2, bus_gbps=1.0).step_ms == pytest.approx(10.0)
    # A fast link hides all but the first all-gather: 3 ms of compute and 6e6 / 2 / 1e12 s.
    assert step_model.model_step(forward, world_size=2, bus_gbps=1000.0).step_ms == pytest.approx(3.003)


def test_a_reduce_scatter_waits_for_the_one_before_it():
    """FSDP2 keeps one reduce-scatter in flight: B's post-backward at 1 ms must wait for A's, which
    takes 10 ms from 0, so the compute stalls 9 ms there."""
    backward = timeline(
        [("step_begin", "", None, 0.0), ("backward_pass", "", None, 0.0),
         ("backward_begin", "A", None, 0.0), ("backward_end", "A", 0, 0.0),
         ("backward_begin", "B", None, 0.0), ("backward_end", "B", 1, 1.0),
         ("optimizer_begin", "", None, 1.0), ("step_end", "", None, 1.0)],
        [("reduce_scatter", "A", 20_000_000), ("reduce_scatter", "B", 2_000_000)])
    model = step_model.model_step(backward, world_size=2, bus_gbps=1.0)
    assert model.step_ms == pytest.approx(11.0)  # the stall to 10 ms, then B's 1 ms reduce-scatter


def test_each_units_compute_leaves_out_the_units_nested_in_it():
    assert step_model.unit_compute_ms(ZERO3) == {"A": [pytest.approx(4.9), pytest.approx(9.8)],
                                                 "B": [pytest.approx(4.9), pytest.approx(9.8)],
                                                 "optimizer": [pytest.approx(4.5), 0.0]}
    # The root's forward holds A's; FSDP2's final callback ends the root's backward before A's.
    nested = timeline([("step_begin", "", None, 0.0), ("forward_begin", "", None, 0.0), ("forward_begin", "A", None, 1.0),
                       ("forward_end", "A", None, 3.0), ("forward_end", "", None, 4.0),
                       ("backward_begin", "", None, 5.0), ("backward_begin", "A", None, 6.0),
                       ("backward_end", "", None, 8.0), ("backward_end", "A", None, 9.0), ("step_end", "", None, 9.0)],
                      [])
    assert step_model.unit_compute_ms(nested) == {"": [2.0, 1.0], "A": [2.0, 3.0]}


def test_timelines_round_trip_through_a_row():
    assert Timeline.from_json(json.loads(json.dumps(ZERO3.to_json()))) == ZERO3


@pytest.mark.parametrize("world_size, bus_gbps", [(1, 350.0), (8, 0.0), (8, -1.0)])
def test_the_model_rejects_what_it_cannot_model(world_size, bus_gbps):
    with pytest.raises(ValueError, match="world_size|bus_gbps"):
        step_model.model_step(ZERO3, world_size=world_size, bus_gbps=bus_gbps)


SHARDS_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
from benchmarks.fsdp2 import worker
from benchmarks.fsdp2.trial import Compilation, Measurement, Numerics, Sharding, Trial, Workload

trial = Trial(Workload(model="stablecode-completion-alpha-3b", n_layer=1, n_embd=128, narrowed=True, block_size=64,
                       micro_batch_size=1, seed=0),
              Numerics(dtype="bfloat16"), Sharding("fsdp2", "zero3", world_size=3, simulated=True),
              Compilation(backend="eager"), Measurement(warmup=1, iters=2))
rank, device = worker.init_distributed(trial)
session = worker.TrainingSession(trial, device, rank)
shards = {name: [list(p.shape), list(p.to_local().shape)]
          for name, p in session.training.parameters_owner.named_parameters()}
result = session.run_steps()
print(json.dumps({"world_size": dist.get_world_size(), "backend": dist.get_backend(), "shards": shards,
                  "timeline": result["sim_timeline"], "units": result["sim_unit_ms"],
                  "uneven": result["sim_uneven_parameters"], "loss": result["loss"]}))
"""


@pytest.fixture(scope="module")
def simulated_session() -> dict:
    """One simulated rank 0 of 3 (zero3, one Block, n_embd 128: not divisible by 3) trained on CPU."""
    finished = subprocess.run([sys.executable, "-c", SHARDS_SCRIPT, str(REPOSITORY)], capture_output=True, text=True,
                              timeout=TIMEOUT_S, cwd=REPOSITORY)
    assert finished.returncode == 0, finished.stderr[-4000:]
    return json.loads(finished.stdout.strip().splitlines()[-1])


def test_rank_zero_holds_its_padded_shard_of_every_parameter(simulated_session):
    assert (simulated_session["backend"], simulated_session["world_size"]) == ("fake", 3)
    for name, (full, local) in simulated_session["shards"].items():
        assert local == [math.ceil(full[0] / 3), *full[1:]], name
    uneven = {name for name, (full, _) in simulated_session["shards"].items() if full[0] % 3}
    assert uneven and set(simulated_session["uneven"]) == uneven


UNITS = ("gpt.transformer.h.0", "gpt.transformer.wte")  # the root's unit holds the rest


def test_collectives_cover_each_units_full_padded_size(simulated_session):
    """Every all-gather's output and reduce-scatter's input is the unit's parameters at full size,
    each padded to 3 x rank 0's shard, in bf16."""
    padded: dict[str, int] = {}
    for name, (full, _) in simulated_session["shards"].items():
        unit = next((unit for unit in UNITS if name.startswith(unit + ".")), "")  # "": the root's
        padded[unit] = padded.get(unit, 0) + math.ceil(full[0] / 3) * 3 * math.prod(full[1:]) * 2
    collectives = Timeline.from_json(simulated_session["timeline"]).collectives
    kinds = {(c.kind, c.unit) for c in collectives}
    assert {(kind, unit) for kind in ("all_gather", "reduce_scatter") for unit in padded} <= kinds
    for collective in collectives:
        assert collective.nbytes == padded[collective.unit], collective
    assert set(simulated_session["units"]) == {*padded, "optimizer"}
    assert all(ms >= 0 for times in simulated_session["units"].values() for ms in times)


def test_simulated_rows_say_so_and_carry_a_modelled_step(tmp_path):
    out = tmp_path / "rows.jsonl"
    command = [sys.executable, str(REPOSITORY / "benchmarks" / "benchmark_fsdp2.py"), "--simulate-world-size", "4",
               "--bus-bandwidth", "0.001", "--compile", "eager", "--n-layer", "1", "--n-embd", "128",
               "--block-size", "64", "--warmup", "1", "--iters", "2", "--plot", "none", "--out", str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path)
    assert finished.returncode == 0, finished.stdout[-4000:] + finished.stderr[-4000:]
    (row,) = load_rows([out])
    assert row["status"] == "ok" and row["simulated"] is True and row["world_size"] == 4
    # One process plays rank 0: the worker started alone, without a torchrun of several.
    assert Path(row["log"]).read_text().splitlines()[0].split()[2:4] == ["-m", "benchmarks.fsdp2.worker"]
    # At 1 MB/s the collectives dominate: the modelled step is the compute and the exposed time.
    assert row["sim_bus_gbps"] == 0.001 and row["sim_step_ms"] > row["sim_compute_ms"] > 0
    assert row["sim_step_ms"] == pytest.approx(row["sim_compute_ms"] + row["sim_exposed_ms"])
    assert "SIMULATED: rank 0 of 4" in finished.stdout and "Modelled step at 4 ranks" in finished.stdout
    assert "Losses of simulated rows are not compared" in finished.stdout


def _row(simulated: bool, backend: str, peak: int, **fields) -> dict:
    return {"row_type": "run", "model": "m", "n_layer": 2, "n_embd": 8, "vocab_size": 16, "micro_batch_size": 1,
            "dtype": "bfloat16", "distributed_mode": "fsdp2", "shard_mode": "zero2", "world_size": 2, "gpu": "G",
            "simulated": simulated, "block_size": 64, "backend": backend, "budget": None, "status": "ok",
            "peak_alloc_max": peak, "peak_reserved_max": peak, "step_ms": 10.0, "date": "2026-12-03T00:00:00+00:00",
            **fields}


def test_the_simulation_error_pairs_each_simulated_row_with_its_real_one():
    from benchmarks.fsdp2 import validation

    rows = [_row(False, "eager", 1000), _row(False, "inductor", 800),
            _row(True, "eager", 1010, sim_compute_ms=9.0, sim_step_ms=9.5),
            _row(True, "inductor", 790, sim_compute_ms=9.0, sim_step_ms=9.0),
            _row(True, "thunder", 700),  # no real row: left out
            _row(True, "eager", 1000, shard_mode="zero3")]  # another setup: left out
    pairs = validation.pair_rows(rows)
    assert [(p.simulated["backend"], p.real["backend"]) for p in pairs] == [("eager", "eager"), ("inductor", "inductor")]
    assert pairs[0].error("peak_alloc_max") == pytest.approx(0.01)
    assert pairs[1].error("peak_alloc_max") == pytest.approx(-0.0125)
    table = validation.markdown(rows)
    assert "SIMULATED against real" in table and "Largest peak-allocated error 1.25%" in table
    assert "| +1.00% |" in table and "| -5.00% |" in table  # the modelled step 9.5 against the real 10
