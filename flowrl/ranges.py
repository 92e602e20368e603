"""The valid values of numeric config fields.

A leaf module (it imports nothing of flowrl), so that a config section declared anywhere (the dataclass tree in
`flowrl.config`, an objective's own section in its module) can say, beside its fields, which values each takes:

    @dataclass
    class NFTSettings:
        RANGES: ClassVar[dict[str, Range]] = {"beta": POSITIVE, "decay_cap": Range(0, 1)}
        beta: float = 1.0
        ...

`flowrl.config` gathers every section's RANGES under its dotted path and checks them once, before any work starts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric field: [lo, hi] with either end open or absent (NaN/inf never pass)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    shown: str = ""  # how text() says it, when not in numbers (e.g. a bound too long for %g)

    def __contains__(self, value: float) -> bool:
        if value != value or value in (float("inf"), float("-inf")):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return not (self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi))

    def text(self) -> str:
        if self.shown:
            return self.shown
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return "a finite number"


POSITIVE, AT_LEAST_0, AT_LEAST_1, FRACTION = Range(0, lo_open=True), Range(0), Range(1), Range(0, 1, True, False)
#: a seed: what torch's generators take (a 64-bit signed integer), from 0
SEED = Range(0, 2**63 - 1, shown="an integer from 0 to 2**63 - 1")
