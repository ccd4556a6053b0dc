"""The long-run check's driver: each setting in fresh processes of ``benchmarks.fsdp2.long_run``,
a progress line every N steps, and its rows appended to --out.

A setting is a backend of the registry with its budget, any trial fields it sets apart from the
command line's, a perturbation of its starting weights (``perturb=SEED``: one weight one rounding
step away, ``long_run.perturb_one_weight``; eager so perturbed is the control for the tail loss:
how far the training's own chaos carries one rounding), and which run of that setting it is (a
repeat is the control for bit-identity: whether the setting repeats its own bits on this device):

    BACKEND[@BUDGET][:FIELD=VALUE[,FIELD=VALUE...]][#N]

    thunder+memopt@0  thunder+memopt-offload@1  eager:seed=1  eager:perturb=1  thunder+memopt@0#2

The rows: one ``long_run_step`` row per step of each setting, then its ``long_run`` row (the
trial, the training, the outcome as the benchmark's rows have it, the corpus, the plan's saved
bytes), linked by ``run_id``. ``--resume`` takes a setting whose run row (ok or OOM, the same key)
is in --out, with its steps, and ``--time-limit`` starts no setting that may not end in time, as
the benchmark's driver does (``driver.Driver``, reused here).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
import types
import typing
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.fsdp2 import backends, driver, long_run
from benchmarks.fsdp2.trial import Compilation, Numerics, Trial, Workload

RUN_ROW = "long_run"
STEP_ROW = "long_run_step"
SUMMARY_ROW = "long_run_summary"
# The trial fields a setting may set apart from the command line's (backend and budget have their
# own place in the spec); a backend's options only where it owns them (Backend.own_fields).
SETTABLE = {field.name: (group, field.name) for group in (Workload, Numerics, Compilation)
            for field in dataclasses.fields(group) if field.name not in ("backend", "budget")}
# The backend whose setting must compute the bits of another's at the same budget: offload copies
# saved tensors to the host and back, and nothing else.
OFFLOAD_TWINS = {"thunder+memopt-offload": "thunder+memopt"}
# With offload the loss head computes its gradients in the backward at any budget; without, at
# budget 1.0 in the forward unless the setting asks for the backward: such a setting is a twin too.
HEAD_IN_BACKWARD = ("head_gradients", "backward")
# An offload setting's twin in the same compiled programs: at a host limit of 1 byte the executor
# makes no copy and keeps each offloaded tensor on the device (executors/offload.py), so the pair
# differs in the round trip through host memory alone.
COPIES_KEPT = ("host_memory_limit", 1)
# The option that moves one starting weight one rounding step (RunSpec.perturbation), not a trial field.
PERTURB = "perturb"
# The setting whose tail loss is held against the others', and its perturbed twin, the noise floor.
REFERENCE = "eager"
SPEC = "BACKEND[@BUDGET][:FIELD=VALUE,...][#N]"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One curve of the check: a backend, its budget, the trial fields it sets, its perturbation,
    its run."""

    backend: str
    budget: float | None = None
    overrides: tuple[tuple[str, Any], ...] = ()
    run: int = 1  # the N-th run of the same setting: a control
    perturbation: int | None = None  # long_run.perturb_one_weight's seed

    @property
    def label(self) -> str:
        name = self.backend if self.budget is None else f"{self.backend} @{self.budget:g}"
        options = [*self.overrides, *([(PERTURB, self.perturbation)] if self.perturbation is not None else [])]
        return (name + "".join(f" [{field}={_text(value)}]" for field, value in options)
                + (f" #{self.run}" if self.run > 1 else ""))

    def trial(self, template: Trial) -> Trial:
        return template.replace(backend=self.backend, budget=self.budget, **dict(self.overrides))


def _text(value: Any) -> str:
    if isinstance(value, tuple):
        return "+".join(value)
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _field_value(field: str, text: str) -> Any:
    """``text`` as a value of trial field ``field``, by its annotation: none, a number, a+b for a
    tuple, else the text."""
    group, name = SETTABLE[field]
    kind = typing.get_type_hints(group)[name]
    kinds = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)
    if text == "none" and type(None) in kinds:
        return None
    base = typing.get_origin(kinds[0]) or kinds[0]
    if base is bool:
        if text not in ("true", "false"):
            raise ValueError(f"{field} takes true or false, got {text!r}")
        return text == "true"
    if base in (int, float):
        return base(text)
    return tuple(text.split("+")) if base is tuple else text


def parse_setting(text: str) -> Setting:
    """A setting from its spec (``SPEC``); ValueError with a one-line message if it is not one."""
    rest, hash_mark, run = text.partition("#")
    rest, _, options = rest.partition(":")
    name, at, budget_text = rest.partition("@")
    backend = backends.BACKENDS.get(name)
    if backend is None:
        raise ValueError(f"{text!r}: unknown backend {name!r} (choose from {', '.join(backends.BACKENDS)})")
    budget = backend.budgets.default[0] if backend.budgets else None
    if at:
        if backend.budgets is None:
            raise ValueError(f"{text!r}: {name} has no budget")
        try:
            budget = float(budget_text)
        except ValueError:
            raise ValueError(f"{text!r}: {budget_text!r} is not a budget") from None
        if not 0.0 <= budget <= 1.0:
            raise ValueError(f"{text!r}: the budget must be in [0, 1]")
    overrides, perturbation = [], None
    for item in filter(None, options.split(",")):
        field, equals, value = item.partition("=")
        if field == PERTURB and equals:
            if not value.isdigit():
                raise ValueError(f"{text!r}: {PERTURB}={value} (a seed: a non-negative integer)")
            perturbation = int(value)
            continue
        if not equals or field not in SETTABLE:
            raise ValueError(f"{text!r}: {item!r} is not FIELD=VALUE with a field of {', '.join(SETTABLE)}, "
                             f"or {PERTURB}=SEED")
        if SETTABLE[field][0] is Compilation and field not in backend.own_fields:
            raise ValueError(f"{text!r}: {field} is not an option of {name}")
        try:
            overrides.append((field, _field_value(field, value)))
        except ValueError as error:
            raise ValueError(f"{text!r}: {field}={value} ({error})") from None
    count = int(run) if hash_mark and run.isdigit() else 1 if not hash_mark else 0
    if count < 1:
        raise ValueError(f"{text!r}: the run after # must be at least 1")
    return Setting(name, budget, tuple(sorted(overrides)), count, perturbation)


def noise_control(settings: list[Setting]) -> Setting | None:
    """The first perturbed run of the reference (eager, as the command line sets it), if listed."""
    return next((setting for setting in settings if setting.backend == REFERENCE and setting.perturbation is not None
                 and not setting.overrides and setting.run == 1), None)


def twin_pairs(settings: list[Setting]) -> list[tuple[Setting, Setting]]:
    """The pairs that must compute the same bits among ``settings``: each offload setting with its
    twins without offload (the same budget and options, offload_keep aside, with or without the loss
    head's gradients in the backward) and with its copies kept on the device (``COPIES_KEPT``), and
    each repeat with the setting's first run."""
    listed = set(settings)
    pairs = []
    for setting in settings:
        if setting.run > 1 and dataclasses.replace(setting, run=1) in listed:
            pairs.append((dataclasses.replace(setting, run=1), setting))
        twin_backend = OFFLOAD_TWINS.get(setting.backend)
        if twin_backend is not None:
            overrides = tuple(item for item in setting.overrides if item[0] != "offload_keep")
            for options in dict.fromkeys([overrides, tuple(sorted({*overrides, HEAD_IN_BACKWARD}))]):
                twin = Setting(twin_backend, setting.budget, options, setting.run, setting.perturbation)
                if twin in listed:
                    pairs.append((setting, twin))
            if not any(field == COPIES_KEPT[0] for field, _ in setting.overrides):
                kept = dataclasses.replace(setting, overrides=tuple(sorted({*setting.overrides, COPIES_KEPT})))
                if kept in listed:
                    pairs.append((setting, kept))
    return pairs


class StepFollower:
    """The rows a worker has appended to its steps file so far, read as it writes them."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.rows = path, 0, []

    def new_rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as steps_file:
            steps_file.seek(self.offset)
            text = steps_file.read()
        complete = text[:text.rfind(b"\n") + 1]  # a line being written waits for the next read
        self.offset += len(complete)
        rows = [json.loads(line) for line in complete.splitlines() if line.strip()]
        self.rows.extend(rows)
        return rows


class Progress:
    """A line every ``every`` steps (the first and the last too): the setting, the step, its loss and
    the mean seconds per step since the line before."""

    def __init__(self, label: str, steps: int, every: int) -> None:
        self.label, self.steps, self.every = label, steps, every
        self.seconds: list[float] = []

    def __call__(self, rows: list[dict]) -> None:
        for row in rows:
            self.seconds.append(row["step_s"])
            done = row["step"] + 1
            if done == 1 or done % self.every == 0 or done == self.steps:
                note = " (compiles)" if done == 1 else ""
                print(f"    {self.label}: step {done}/{self.steps}, loss {row['loss']:.4f}, "
                      f"{statistics.mean(self.seconds):.3f} s/step{note}", flush=True)
                self.seconds = []


def launch(spec: long_run.RunSpec, log_path: Path, timeout_s: float,
           on_rows: Callable[[list[dict]], None]) -> tuple[dict, list[dict]]:
    """Run ``spec`` in fresh processes (``driver.launch_worker``, with cold
    compile caches: nothing compiled for another setting reaches this one), handing ``on_rows`` each
    step's row as it comes; its outcome (``driver.trial_outcome``) and its step rows."""
    followers: dict[Path, StepFollower] = {}

    def follow(work_dir: Path) -> None:
        follower = followers.setdefault(work_dir, StepFollower(work_dir / long_run.STEPS_FILE))
        on_rows(follower.new_rows())

    outcome = driver.launch_worker(long_run.__name__, spec.to_json(), spec.trial.sharding.processes, log_path,
                                   timeout_s, watch=follow)
    return outcome, [row for follower in followers.values() for row in follower.rows]


@dataclasses.dataclass(frozen=True)
class Training:
    """What every setting of one invocation shares: the steps, the schedule, the progress lines."""

    steps: int
    schedule: long_run.Schedule
    progress_every: int
    deterministic: bool = True

    def fields(self) -> dict[str, Any]:
        return {"steps": self.steps, **dataclasses.asdict(self.schedule), "deterministic": self.deterministic}

    def spec(self, trial: Trial, perturbation: int | None = None) -> long_run.RunSpec:
        return long_run.RunSpec(trial, self.steps, self.schedule, self.deterministic, perturbation)


def run_setting(runner: driver.Driver, template: Trial, setting: Setting, training: Training,
                index: int, count: int) -> tuple[dict, list[dict]]:
    """The run row and the step rows of ``setting``: from --out with --resume, else trained now and
    appended. Raises driver.TimeLimitReached where --time-limit leaves too little time."""
    trial = setting.trial(template)
    key = {"row_type": RUN_ROW, "setting": setting.label, **trial.key(), **training.fields()}
    earlier = runner.earlier_row(key)
    if earlier is not None:
        steps = [row for row in runner.earlier_rows
                 if row.get("row_type") == STEP_ROW and row.get("run_id") == earlier["run_id"]]
        print(f"[{index}/{count}] {setting.label}: {earlier['status']} in {runner.out} (--resume)", flush=True)
        return earlier, steps
    timeout_s, limited_by_deadline = runner.trial_timeout()
    log_path = runner.log_dir / f"{time.strftime('%Y%m%d-%H%M%S')}_{setting.label.replace(' ', '')}.log"
    print(f"[{index}/{count}] {setting.label}: {backends.describe_trial(trial)}, {training.steps} steps, "
          f"log {log_path}", flush=True)
    started = time.monotonic()
    outcome, steps = launch(training.spec(trial, setting.perturbation), log_path, timeout_s,
                            Progress(setting.label, training.steps, training.progress_every))
    elapsed = time.monotonic() - started
    if outcome["status"] == "timeout" and limited_by_deadline:
        raise driver.TimeLimitReached
    runner.longest_trial_s = max(runner.longest_trial_s, elapsed)
    run_id = uuid.uuid4().hex
    row = {**key, **runner.context(), "run_id": run_id, "log": str(log_path), "wall_s": elapsed, **outcome}
    steps = [{"row_type": STEP_ROW, "run_id": run_id, "setting": setting.label, **step} for step in steps]
    with open(runner.out, "a") as out:
        out.writelines(json.dumps(step_row) + "\n" for step_row in steps)
        out.write(json.dumps(row) + "\n")
    if outcome["status"] != "ok":
        print(f"    -> {outcome['status']}: {(outcome.get('error') or '').splitlines()[0][:300]}", flush=True)
    return row, steps


def run_settings(runner: driver.Driver, template: Trial, settings: list[Setting],
                 training: Training) -> tuple[list[dict], dict[str, list[dict]]]:
    """Every setting in order: their run rows, and each label's step rows."""
    runs, steps = [], {}
    for index, setting in enumerate(settings, 1):
        row, rows = run_setting(runner, template, setting, training, index, len(settings))
        runs.append(row)
        steps[setting.label] = rows
    return runs, steps


def append_summary(runner: driver.Driver, verdict_json: dict) -> None:
    with open(runner.out, "a") as out:
        out.write(json.dumps({"row_type": SUMMARY_ROW, **runner.context(), **verdict_json}) + "\n")
