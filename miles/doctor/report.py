"""The doctor's answer: text for people, JSON for scripts; exit 0 healthy, 1 symptoms found."""

from __future__ import annotations

import json
from dataclasses import asdict

from miles.doctor.checks import CHECKS, THRESHOLDS, Finding
from miles.doctor.run import RunRecord


def _remedy_lines(finding: Finding, indent: str) -> list[str]:
    lines = []
    for remedy in finding.remedies:
        flags = " ".join(remedy.flags)
        lines.append(f"{indent}{flags:<34}  {remedy.why}" if flags else f"{indent}{remedy.why}")
    return lines


def format_text(run: RunRecord, findings: list[Finding], compare: RunRecord | None = None) -> str:
    steps = run.steps
    against = f", compared with {compare.path}" if compare else ""
    head = f"miles doctor: {run.path} ({len(steps)} steps, {len(CHECKS)} checks{against})"
    if not findings:
        return f"{head}\nhealthy: no known symptom in {len(steps)} steps"
    lines = [head]
    for finding in findings:
        lines.append(f"\nSYMPTOM {finding.check}: {finding.symptom}")
        lines += [f"  evidence: {e}" for e in finding.evidence]
        lines.append(f"  likely cause: {finding.cause}")
        if finding.remedies:
            lines.append("  remedies (flags of miles train):")
            lines += _remedy_lines(finding, "    ")
        for follow in finding.explains:
            lines.append(
                f"  explains {follow.check}: {follow.symptom} ({'; '.join(map(str, follow.evidence))})"
            )
    lines.append(f"\n{len(findings)} symptom(s); thresholds: docs/troubleshooting.md")
    return "\n".join(lines)


def format_json(run: RunRecord, findings: list[Finding], compare: RunRecord | None = None) -> str:
    return json.dumps(
        {
            "run": str(run.path),
            "compare": str(compare.path) if compare else None,
            "steps": len(run.steps),
            "healthy": not findings,
            "findings": [asdict(f) for f in findings],
            "thresholds": THRESHOLDS,
        },
        indent=2,
        default=str,
    )
