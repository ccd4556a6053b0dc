"""The simulation's error: simulated rows (``--simulate-world-size N``) against real rows of N ranks.

A simulated row plays rank 0 of N on one GPU under the fake process group. Its peak is only worth
quoting beside the error of the same measurement against real ranks, so this module pairs each
simulated row with the real row of the same setup and gives the relative error of its peaks, and
its measured compute against the real step (the real step holds the collectives too).

Two rows pair when they agree on every configuration field but ``simulated`` (``tables.config_of``,
which reads a row from before a field existed as the value it then had), on the block size, the
backend, its budget and its options. The latest row of each measurement counts (``tables.latest``).

    python benchmarks/make_table.py SIMULATED.jsonl REAL.jsonl --simulation-error
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.fsdp2 import backends, tables
from benchmarks.fsdp2.trial import field_value

SIMULATED_FIELD = tables.CONFIG_FIELDS.index("simulated")


@dataclass(frozen=True)
class SimulationError:
    """One backend's simulated row and the real row it stands for."""

    simulated: dict
    real: dict

    def error(self, field: str) -> float | None:
        """(simulated - real) / real of a byte or time field; None where either lacks it."""
        sim, real = self.simulated.get(field), self.real.get(field)
        return None if sim is None or not real else (sim - real) / real


def identity(row: dict) -> tuple:
    """What a simulated row and its real row share: the setup less ``simulated``, the block size,
    the backend, its budget and options."""
    config = list(tables.config_of(row, with_block_size=True))
    del config[SIMULATED_FIELD]
    return (*config, row["backend"], row.get("budget"), backends.tags(row))


def pair_rows(rows: list[dict]) -> list[SimulationError]:
    """Each ok simulated row with the ok real row of the same measurement, in the simulated rows' order."""
    measured = [row for row in tables.measured_rows(tables.latest(rows)) if tables.has_peak(row)]
    real = {identity(row): row for row in measured if not field_value(row, "simulated")}
    return [SimulationError(row, real[identity(row)]) for row in measured
            if field_value(row, "simulated") and identity(row) in real]


def percent(value: float | None) -> str:
    return tables.MISSING if value is None else f"{value:+.2%}"


COLUMNS = [
    ("T", lambda e: str(e.real["block_size"])),
    ("backend", lambda e: backends.label(e.real)),
    ("peak alloc GiB, simulated / real", lambda e: f"{tables.number(e.simulated['peak_alloc_max'], '.2f', tables.GIB)}"
                                                   f" / {tables.number(e.real['peak_alloc_max'], '.2f', tables.GIB)}"),
    ("alloc error", lambda e: percent(e.error("peak_alloc_max"))),
    ("peak reserved GiB, simulated / real",
     lambda e: f"{tables.number(e.simulated.get('peak_reserved_max'), '.2f', tables.GIB)}"
               f" / {tables.number(e.real.get('peak_reserved_max'), '.2f', tables.GIB)}"),
    ("reserved error", lambda e: percent(e.error("peak_reserved_max"))),
    ("compute ms simulated / real step ms", lambda e: f"{tables.number(e.simulated.get('sim_compute_ms'), '.0f')}"
                                                      f" / {tables.number(e.real.get('step_ms'), '.0f')}"),
    ("step ms modelled", lambda e: tables.number(e.simulated.get("sim_step_ms"), ".0f")),
    ("modelled error", lambda e: percent(None if e.simulated.get("sim_step_ms") is None or not e.real.get("step_ms")
                                         else e.simulated["sim_step_ms"] / e.real["step_ms"] - 1)),
]


def markdown(rows: list[dict]) -> str:
    """A table per setup: each simulated row's peaks and step against its real row's."""
    pairs = pair_rows(rows)
    if not pairs:
        return "No simulated row has a real row of the same setup among these files."
    groups: dict[tuple, list[SimulationError]] = {}
    for pair in pairs:
        groups.setdefault(tables.config_of(pair.real), []).append(pair)
    sections = []
    for group in groups.values():
        sim, real = group[0].simulated, group[0].real
        worst = max(abs(pair.error("peak_alloc_max")) for pair in group)
        sections.append(
            f"#### SIMULATED against real: {tables.heading(real)}\n\n"
            f"Simulated: {sim['date'][:16]} UTC, package tree {sim.get('memopt_tree', tables.MISSING)[:8]}; "
            f"real: {real['date'][:16]} UTC. Largest peak-allocated error {worst:.2%}.\n\n"
            + tables.table(COLUMNS, group))
    return "\n\n".join(sections)
