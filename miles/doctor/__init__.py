"""`miles doctor`: known RL failure symptoms checked on a run's own numbers (see checks.py)."""

from miles.doctor.checks import CHECKS, Evidence, Finding, Remedy, check, diagnose
from miles.doctor.run import RunRecord, load_run

__all__ = ["CHECKS", "Evidence", "Finding", "Remedy", "RunRecord", "check", "diagnose", "load_run"]
