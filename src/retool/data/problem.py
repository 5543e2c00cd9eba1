"""The unit of work every stage passes along: one math problem with its reference answer."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    answer: str
    data_source: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)
