"""How a finished trajectory gets its reward: the default scorer and the shapes a custom one has.

The rollout engine calls one ``TrajectoryScorer`` per finished trajectory, as soon as it ends (so scoring
overlaps the other trajectories' sampling). The default, ``score_final_answer``, is the chapter's reward
(SPEC §5): only a trajectory that stopped with an answer is checked, by the verifier, on the text of its
last assistant turn; every other stop is -1. An environment (``retool.env.ProblemEnv.score``) may score
differently; the engine only needs the coroutine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from retool.rollout.types import Trajectory


class AnswerScore(Protocol):
    """What a verifier returns for one answer (``retool.reward.RewardResult`` has this shape)."""

    @property
    def reward(self) -> float: ...
    @property
    def correct(self) -> bool: ...
    @property
    def valid_format(self) -> bool: ...
    @property
    def answer(self) -> str | None: ...
    @property
    def status(self) -> str: ...


class VerifierLike(Protocol):
    """The part of ``retool.reward.Verifier`` a rollout needs."""

    async def ascore(self, text: str, ref: str) -> AnswerScore: ...


# Sets ``reward``, ``correct``, ``valid_format`` (and ``answer``, ``reward_status``) of one trajectory.
TrajectoryScorer = Callable[[Trajectory], Awaitable[None]]


async def score_final_answer(trajectory: Trajectory, verifier: VerifierLike) -> None:
    """+1 / -1 from the verifier's check of the final answer; -1 for any stop other than ``answer``."""
    if trajectory.stop_reason != "answer":
        trajectory.reward, trajectory.correct, trajectory.valid_format = -1.0, False, False
        return
    result = await verifier.ascore(trajectory.final_text, trajectory.problem.answer)
    trajectory.reward = float(result.reward)
    trajectory.correct = bool(result.correct)
    trajectory.valid_format = bool(result.valid_format)
    trajectory.answer = result.answer
    trajectory.reward_status = str(result.status)
