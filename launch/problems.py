"""A refused job: every problem names the field, shows the arithmetic and says how to fix it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One reason a job cannot run as configured.

    ``field`` is the dotted config path (``parallelism.tp``), ``arithmetic`` the numbers that
    fail (``world 12 % (tp 8 * pp 1 * cp 1) = 4, not 0``) and ``fix`` a concrete override.
    """

    field: str
    message: str
    arithmetic: str = ""
    fix: str = ""

    def __str__(self) -> str:
        parts = [f"{self.field}: {self.message}"]
        if self.arithmetic:
            parts.append(f"    arithmetic: {self.arithmetic}")
        if self.fix:
            parts.append(f"    fix: {self.fix}")
        return "\n".join(parts)


class JobRefused(Exception):
    """Raised by the entry points when check(job) returned problems; nothing was submitted."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__(format_problems(problems))


def format_problems(problems: list[Problem]) -> str:
    head = f"refused: {len(problems)} problem(s); nothing was submitted"
    return "\n".join([head] + [f"- {p}" for p in problems])
