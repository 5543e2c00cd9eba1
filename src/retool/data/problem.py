"""The unit of work every stage passes along: one math problem with its reference answer."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    answer: str
    data_source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
