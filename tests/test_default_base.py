"""The default base model's teacher data: the job's held-out problems never appear in it, and
the bare/equation mix is what docs/default_job.md says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from miles.cli import DEFAULT_JOB
from miles.config.loader import load_config
from miles.data.run_data import build_data

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "make_default_base.py"


def test_teacher_data_excludes_held_out_and_mixes_formats():
    spec = importlib.util.spec_from_file_location("make_default_base", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    records = module.teacher_records(size=3000, bare_fraction=0.45, seed=1)
    held_out = {str(i.prompt) for i in build_data(load_config(["--config", str(DEFAULT_JOB)])).eval_items}
    assert records and not held_out & {r["input"] for r in records}
    bare = [r for r in records if " = " not in r["label"]]
    assert 0.40 < len(bare) / len(records) < 0.50
    for r in records:  # the equation is the problem's own, and it ends in the right answer
        if " = " in r["label"]:
            expression, answer = r["label"].split(" = ")
            assert r["input"] == f"Calculate {expression}."
            assert int(answer) == eval(expression)  # 1-2 digit + and - only
        else:
            assert int(r["label"]) == eval(r["input"][len("Calculate ") : -1])
