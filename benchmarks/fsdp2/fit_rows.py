"""What a thunder+memopt-fit row records of ``MemoryOptimization(memory_limit=...)``: its plan
(``fit_report()``) and its checks against the measured peak after the warm-up, as flat JSON fields.

The worker checks the last warm-up step's peak (``check_fit``); where the check plans again, one
more warm-up step compiles the second plan and is checked too. ``fit_fields`` turns the report and
those checks into the row's ``fit_*`` fields, so that a row says how far the prediction was from
the measurement and which plan ran. It is pure: the tables and tests read it without a GPU.

Nothing here imports torch (the fit's types only for annotations).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from thunder_memopt.passes.fit import FitCheck, FitChoice, FitReport


def check_fields(check: FitCheck) -> dict[str, Any]:
    """One check: the prediction it held the measured peak against, and what followed."""
    return {"predicted_bytes": check.predicted_bytes, "measured_bytes": check.measured_bytes,
            "replan": check.replan, "margin_bytes": check.margin_bytes}


def term_fields(choice: FitChoice) -> dict[str, int]:
    """One program's terms of its predicted whole-step peak at the rung it took (``fit.StepTerms``),
    to tell which term a prediction's error is in."""
    terms, rung = choice.terms, choice.rungs[choice.rung]
    return {"static_bytes": terms.static_bytes, "first_step_bytes": terms.first_step_bytes, "calls": terms.calls,
            "call_gathered_bytes": terms.call_gathered_bytes, "call_gradient_bytes": terms.call_gradient_bytes,
            "saved_bytes": rung.saved_bytes, "pair_peak_bytes": rung.pair_peak_bytes,
            "offloaded_bytes": rung.offloaded_bytes, "margin_bytes": terms.margin_bytes,
            "peak_bytes": terms.peak(rung), "predicted_peak_bytes": choice.predicted_peak_bytes}


def fit_fields(report: FitReport, checks: Sequence[FitCheck]) -> dict[str, Any]:
    """The row's fields for the plan in ``report`` and the ``checks`` made after the warm-up, in
    order (none on CPU, where there is no allocator peak to check).

    The predicted peak is the last check's (each program's calls per step counted, the margin
    included); without a check, the plan's own. Per program, in compile order: the rung taken, of
    how many, and the bytes one call saves for its backward at that rung (``fit_saved_bytes_total``
    sums those over the programs, one call each), and the terms of its prediction (``term_fields``;
    ``peak_bytes`` its own, ``predicted_peak_bytes`` with the later programs its saves raise)."""
    last = checks[-1] if checks else None
    saved = [choice.rungs[choice.rung].saved_bytes for choice in report.choices]
    return {
        "fit_limit_bytes": report.limit_bytes,
        "fit_predicted_peak_bytes": report.predicted_peak_bytes if last is None else last.predicted_bytes,
        "fit_measured_peak_bytes": None if last is None else last.measured_bytes,
        "fit_replanned": any(check.replan for check in checks),
        # The latest plan's margin: a second plan's, where a check asked for one.
        "fit_margin_bytes": max(choice.terms.margin_bytes for choice in report.choices),
        "fit_fits": report.fits,  # every program's chosen rung predicted under the limit
        "fit_checks": [check_fields(check) for check in checks],
        "fit_programs": len(report.choices),
        "fit_rungs": [choice.rung for choice in report.choices],
        "fit_ladder_rungs": [len(choice.rungs) for choice in report.choices],
        "fit_saved_bytes": saved,
        "fit_saved_bytes_total": sum(saved),
        "fit_terms": [term_fields(choice) for choice in report.choices],
        # The cap put on the caching allocator at the first plan, a fraction of the device's memory
        # (``MemoryOptimization(cap_allocator=True)``); None where the process was capped already.
        "fit_allocator_fraction": report.allocator_fraction,
    }
