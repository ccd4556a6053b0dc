"""The long-run check's verdict: from each setting's per-step losses, whether its curve stays with
eager's, whether any step is NaN or inf, and whether settings that must compute the same bits do.

- **Against eager**: the mean loss over the last ``tail`` steps of each setting, and its relative
  difference from the reference setting's (eager's), against ``max(rtol, noise_factor x the noise
  floor)`` (``loss_tolerance``). The noise floor is that same difference of the control, eager
  started one rounding step of one weight away: how far the training's own chaos carries one
  rounding, which a backend that rounds differently cannot be expected to beat. Without a control,
  ``rtol`` alone.
- **Finite**: every step's loss and parameter norm.
- **Bit-identical pairs**: two settings that must give the same bits (thunder+memopt-offload at
  budget B against thunder+memopt at budget B: offload copies tensors to the host and back and
  changes no value; a setting against a repeat of itself, the control) have equal losses, and
  equal norms of the parameters after each step, bit for bit, at every step; else the first step
  where they differ. Where their plans save different tensors for backward (the run rows'
  ``plan_saved_*``), the two recompute different things, and the pair is reported as not
  comparable rather than failed.

Nothing here imports torch; the plot uses matplotlib on its file-only backend (``plots.pyplot``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.fsdp2 import plots

# What each step row holds that a bit-identical pair must share.
COMPARED_FIELDS = ("loss", "params_norm")
PLAN_FIELDS = ("plan_saved_bytes", "plan_saved_storages")


@dataclasses.dataclass(frozen=True)
class SettingCheck:
    """One setting's curve: complete, finite, and where it ends against the reference's."""

    label: str
    status: str
    steps: int  # steps with a row
    expected_steps: int
    nonfinite_steps: tuple[int, ...]  # steps whose loss or parameter norm is NaN or inf
    tail_mean: float | None  # mean loss over the last ``tail`` steps (None: not all ran)
    relative_difference: float | None  # of tail_mean from the reference's
    within: bool | None  # relative_difference <= the verdict's tolerance; None: nothing to compare

    @property
    def passed(self) -> bool:
        return (self.status == "ok" and self.steps == self.expected_steps and not self.nonfinite_steps
                and self.within is not False)


@dataclasses.dataclass(frozen=True)
class PairCheck:
    """Two settings that must compute the same bits."""

    first: str
    second: str
    compared_steps: int
    same_plan: bool | None  # None: a plan was not measured
    # The first step at which each compared field differs (None: equal at every compared step), and
    # the two values there.
    differences: dict[str, tuple[int, float, float] | None]
    complete: bool  # both ran every step

    @property
    def identical(self) -> bool:
        return self.complete and all(found is None for found in self.differences.values())

    @property
    def passed(self) -> bool:
        return self.identical or self.same_plan is False


@dataclasses.dataclass(frozen=True)
class Verdict:
    settings: list[SettingCheck]
    pairs: list[PairCheck]
    reference: str | None
    tail: int
    rtol: float
    control: str | None  # the perturbed reference, whose distance is the noise floor
    noise_floor: float | None  # its relative difference from the reference (None: no control, or unfinished)
    noise_factor: float
    tolerance: float  # loss_tolerance(rtol, noise_factor, noise_floor): each setting's limit

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.settings) and all(pair.passed for pair in self.pairs)

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "reference": self.reference, "tail_steps": self.tail, "loss_rtol": self.rtol,
                "control": self.control, "noise_floor": self.noise_floor, "noise_factor": self.noise_factor,
                "loss_tolerance": self.tolerance,
                "settings": [{**dataclasses.asdict(check), "passed": check.passed} for check in self.settings],
                "pairs": [{**dataclasses.asdict(pair), "identical": pair.identical, "passed": pair.passed}
                          for pair in self.pairs]}


def same_bits(a: float, b: float) -> bool:
    """Equal as IEEE doubles bit for bit (so -0.0 is not 0.0, and a NaN equals a NaN of its kind)."""
    return a.hex() == b.hex()


def first_difference(a: Sequence[Mapping], b: Sequence[Mapping], field: str) -> tuple[int, float, float] | None:
    for row_a, row_b in zip(a, b):
        if not same_bits(float(row_a[field]), float(row_b[field])):
            return row_a["step"], row_a[field], row_b[field]
    return None


def tail_mean(steps: Sequence[Mapping], tail: int) -> float:
    return math.fsum(row["loss"] for row in steps[-tail:]) / len(steps[-tail:])


def loss_tolerance(rtol: float, noise_factor: float, noise_floor: float | None) -> float:
    """The largest relative difference of a tail mean from the reference's that passes:
    ``max(rtol, noise_factor * noise_floor)``, or ``rtol`` where there is no noise floor."""
    return rtol if noise_floor is None else max(rtol, noise_factor * noise_floor)


def relative_difference(mean: float | None, reference_mean: float | None) -> float | None:
    if mean is None or reference_mean is None or not math.isfinite(mean):
        return None
    return abs(mean - reference_mean) / abs(reference_mean)


def check_setting(run: Mapping, steps: Sequence[Mapping], reference_mean: float | None, expected: int, tail: int,
                  tolerance: float) -> SettingCheck:
    nonfinite = tuple(row["step"] for row in steps
                      if not all(math.isfinite(row[field]) for field in COMPARED_FIELDS))
    mean = tail_mean(steps, tail) if len(steps) == expected else None
    difference = relative_difference(mean, reference_mean)
    return SettingCheck(run["setting"], run["status"], len(steps), expected, nonfinite, mean, difference,
                        None if difference is None else difference <= tolerance)


def check_pair(first: Mapping, second: Mapping, steps: Mapping[str, Sequence[Mapping]], expected: int) -> PairCheck:
    a, b = steps[first["setting"]], steps[second["setting"]]
    plans = [tuple(run.get(field) for field in PLAN_FIELDS) for run in (first, second)]
    same_plan = None if None in plans[0] + plans[1] else plans[0] == plans[1]
    return PairCheck(first["setting"], second["setting"], min(len(a), len(b)), same_plan,
                     {field: first_difference(a, b, field) for field in COMPARED_FIELDS},
                     len(a) == expected and len(b) == expected)


def analyse(runs: Sequence[Mapping], steps: Mapping[str, Sequence[Mapping]], pairs: Sequence[tuple[str, str]],
            *, reference: str | None, expected_steps: int, tail: int, rtol: float, control: str | None = None,
            noise_factor: float = 1.5) -> Verdict:
    """``runs``: a run row per setting (``setting`` its label); ``steps``: each label's step rows in
    order; ``pairs``: labels that must compute the same bits; ``reference``: the label the others'
    tail means are held against (eager), None for none; ``control``: the reference perturbed, whose
    distance from it sets the noise floor, None for none."""
    by_label = {run["setting"]: run for run in runs}

    def finished_mean(label: str | None) -> float | None:
        if label not in by_label or len(steps[label]) != expected_steps:
            return None
        return tail_mean(steps[label], tail)

    reference_mean = finished_mean(reference)
    noise_floor = relative_difference(finished_mean(control), reference_mean)
    tolerance = loss_tolerance(rtol, noise_factor, noise_floor)
    checks = [check_setting(run, steps[run["setting"]], None if run["setting"] == reference else reference_mean,
                            expected_steps, tail, tolerance) for run in runs]
    pair_checks = [check_pair(by_label[a], by_label[b], steps, expected_steps) for a, b in pairs]
    return Verdict(checks, pair_checks, reference if reference in by_label else None, tail, rtol,
                   control if control in by_label else None, noise_floor, noise_factor, tolerance)


def _value(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _steps(found: tuple[int, ...]) -> str:
    shown = ", ".join(map(str, found[:5]))
    return "none" if not found else shown + (f" and {len(found) - 5} more" if len(found) > 5 else "")


def pair_outcome(pair: PairCheck) -> str:
    if pair.same_plan is False:
        outcome = "NOT COMPARABLE: their plans save different tensors for backward (they recompute different things)"
    elif pair.identical:
        return f"identical at all {pair.compared_steps} steps"
    else:
        outcome = "DIFFER"
    found = [f"{field} first differs at step {difference[0]} ({difference[1]!r} against {difference[2]!r})"
             for field, difference in pair.differences.items() if difference is not None]
    if not pair.complete:
        found.append(f"only {pair.compared_steps} steps ran in both")
    return f"{outcome}; " + "; ".join(found) if found else f"{outcome}; equal at all {pair.compared_steps} steps"


def tolerance_text(verdict: Verdict) -> str:
    """Where the tolerance on the tail mean comes from, in a sentence."""
    if verdict.reference is None:
        return "No reference setting among these: no tail mean is compared."
    rule = f"A setting passes within {verdict.tolerance:.3%} of {verdict.reference}'s"
    if verdict.control is None:
        return f"{rule} (--loss-rtol; no perturbed control among these settings)."
    if verdict.noise_floor is None:
        return f"{rule} (--loss-rtol: the control {verdict.control} did not finish, so there is no noise floor)."
    return (f"Noise floor: {verdict.control} (one rounding step of one starting weight away) ends "
            f"{verdict.noise_floor:.3%} from {verdict.reference}. {rule}: max({verdict.rtol:.3%}, "
            f"{verdict.noise_factor:g} x {verdict.noise_floor:.3%}).")


def checklist(verdict: Verdict) -> list[str]:
    """One line per criterion: the tail means, NaN or inf, the bit-identical pairs."""
    compared = [check for check in verdict.settings if check.within is not None]
    nonfinite = [f"{check.label} (steps {_steps(check.nonfinite_steps)})" for check in verdict.settings
                 if check.nonfinite_steps]
    identical = [pair for pair in verdict.pairs if pair.identical]
    return [f"- Tail mean within {verdict.tolerance:.3%} of {verdict.reference or 'the reference'}'s: "
            f"{sum(check.within for check in compared)} of {len(compared)} settings compared",
            f"- NaN or inf: {'in ' + '; '.join(nonfinite) if nonfinite else 'none at any step of any setting'}",
            f"- Bit-identical pairs: {len(identical)} of {len(verdict.pairs)}"]


def markdown(verdict: Verdict) -> str:
    """The verdict as markdown: the noise floor and the tolerance, a table of the settings, one line
    per pair, then one per criterion."""
    reference = verdict.reference or "the reference"
    lines = [f"Mean loss over the last {verdict.tail} steps against {reference}'s. {tolerance_text(verdict)}",
             "", f"| setting | status | steps | NaN/inf steps | mean loss, last steps | distance from {reference} | "
                 f"within {verdict.tolerance:.3%} | ok |",
             "|---|---|---|---|---|---|---|---|"]
    for check in verdict.settings:
        inside = {None: "–", True: "yes", False: "NO"}[check.within]
        lines.append(f"| {check.label} | {check.status} | {check.steps}/{check.expected_steps} | "
                     f"{_steps(check.nonfinite_steps)} | {_value(check.tail_mean, '.5f')} | "
                     f"{_value(check.relative_difference, '.3%')} | {inside} | {'yes' if check.passed else 'NO'} |")
    if verdict.pairs:
        lines += ["", "Settings that must compute the same bits (loss and parameter norm at every step):", ""]
        lines += [f"- {pair.first} against {pair.second}: {pair_outcome(pair)}" for pair in verdict.pairs]
    lines += ["", *checklist(verdict), "", f"Verdict: {'PASSED' if verdict.passed else 'FAILED'}"]
    return "\n".join(lines)


def plot(runs: Sequence[Mapping], steps: Mapping[str, Sequence[Mapping]], reference: str | None, path: Path,
         title: str) -> None:
    """Every setting's loss per step and, where there is a reference, its difference from it."""
    plt = plots.pyplot()
    panels = 2 if reference in steps else 1
    figure, axes = plt.subplots(1, panels, figsize=(8 * panels, 5), squeeze=False)
    for index, run in enumerate(runs):
        rows = steps[run["setting"]]
        axes[0][0].plot([row["step"] for row in rows], [row["loss"] for row in rows], color=f"C{index}",
                        linewidth=0.8, label=run["setting"])
        if panels == 2 and run["setting"] != reference:
            base = {row["step"]: row["loss"] for row in steps[reference]}
            shared = [row for row in rows if row["step"] in base]
            axes[0][1].plot([row["step"] for row in shared], [row["loss"] - base[row["step"]] for row in shared],
                            color=f"C{index}", linewidth=0.8, label=run["setting"])
    axes[0][0].set_ylabel("loss (rank 0's batch)")
    if panels == 2:
        axes[0][1].axhline(0.0, color="black", linewidth=0.5)
        axes[0][1].set_ylabel(f"loss minus {reference}'s")
    for axis in axes[0]:
        axis.set_xlabel("step")
        axis.legend(fontsize=7)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
