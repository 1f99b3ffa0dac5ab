"""One row of the doctor's table, and how an error a check caught becomes a row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK | WARN | FAIL
    evidence: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAIL


def split_fix(message: str) -> tuple[str, str]:
    """Our error messages end with the fix after '; ' or '. '; split it off for the fix column."""
    message = " ".join(message.split())
    for sep in ("; ", ". "):
        head, found, tail = message.rpartition(sep)
        if found and head:
            return head, tail.rstrip(".")
    return message, ""


def from_error(name: str, err: BaseException) -> Check:
    evidence, fix = split_fix(str(err) or type(err).__name__)
    return Check(name, FAIL, evidence, fix)


def guarded(name: str, fn: Callable[[], list[Check]]) -> list[Check]:
    """Run a check; anything it raises (our one-sentence errors included) becomes a failing row."""
    try:
        return fn()
    except Exception as err:  # a check must report, never crash the table
        return [from_error(name, err)]


def render_text(rows: list[Check]) -> str:
    """One line per check, so each failure reads as one line in a terminal or CI log."""
    width = max(len(r.name) for r in rows)
    lines = [f"{'status':6} {'check':{width}}  evidence  ->  fix"]
    for r in rows:
        fix = f"  ->  {r.fix}" if r.fix else ""
        lines.append(f"{r.status:6} {r.name:{width}}  {r.evidence}{fix}")
    return "\n".join(lines)


def render_markdown(rows: list[Check]) -> str:
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    lines = ["| check | status | evidence | fix |", "| --- | --- | --- | --- |"]
    lines += [f"| {esc(r.name)} | {r.status} | {esc(r.evidence)} | {esc(r.fix)} |" for r in rows]
    return "\n".join(lines) + "\n"
