"""`--profile`: a torch.profiler trace of a few RL steps, and a table of where the time went.

Steps are marked `miles.rollout`, `miles.train` and `miles.sync` (torch.profiler's
`record_function`), so the trace shows which phase an operator belongs to. After one warm-up
step, `active` steps are recorded; then `--profile-dir` (default `<run dir>/profile`) holds
`trace.json` (open it in https://ui.perfetto.dev or chrome://tracing) and `summary.txt` (the
operators with the most self time: CPU, and CUDA where a GPU ran).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from miles.runtime.parts import RunPart, Step

log = logging.getLogger("miles")

PHASES = ("miles.rollout", "miles.train", "miles.sync")


class StepProfiler:
    """Call `step()` after each RL step; `phase(name)` marks a part of one."""

    def __init__(
        self, out_dir: Path | None, warmup: int = 1, active: int = 2, steps: int | None = None
    ) -> None:
        """`steps`: the RL steps the run will take, to say when fewer than warm-up + active are left."""
        self.out_dir = out_dir
        self.prof = None
        if out_dir is None:
            return
        if steps is not None and steps < warmup + active:
            log.warning(
                "--profile records %d steps after %d warm-up step(s), but this run takes %d: the trace holds %d",
                active, warmup, steps, max(0, steps - warmup),
            )  # fmt: skip
        out_dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self._write,
        )
        self.prof.start()

    def phase(self, name: str) -> AbstractContextManager:
        return record_function(name) if self.prof is not None else nullcontext()

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()

    def close(self) -> None:
        if self.prof is not None:
            self.prof.stop()  # writes the trace if the run ended before the recorded steps did
            self.prof = None

    def _write(self, prof) -> None:
        prof.export_chrome_trace(str(self.out_dir / "trace.json"))
        by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        (self.out_dir / "summary.txt").write_text(prof.key_averages().table(sort_by=by, row_limit=30) + "\n")
        log.info("profile written to %s (trace.json, summary.txt)", self.out_dir)


class ProfilerPart(RunPart):
    """--profile as a run part: the rollout, train and sync phases marked, a profiler step per RL step."""

    name = "profiler"

    def __init__(self, out_dir: Path, total_steps: int) -> None:
        self.out_dir, self.total_steps = out_dir, total_steps
        self.profiler: StepProfiler | None = None

    def begin(self, start: int) -> None:
        self.profiler = StepProfiler(self.out_dir, steps=self.total_steps - start)

    def phase(self, name: str, step: Step) -> AbstractContextManager:
        if self.profiler is None or f"miles.{name}" not in PHASES:
            return nullcontext()
        return self.profiler.phase(f"miles.{name}")

    def after(self, step: Step) -> None:
        self.profiler.step()

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
