"""Scripted expert of the `recall` environment: read every digit, summarize, answer the code.

It calls `next_digit` until a result says the last digit came (`digit 6 of 6: 4`), then
answers with the digits in order. Each call after the first comes after a running note, the
digits read so far (`739` then the call), so every digit it writes is either the digit the
tool has just revealed or a copy of its own last note: never a look-up of the `digit k of 6`
result among several. (Without the notes, recall's tiny warm start never learnt to copy the
last digit into the answer: right in 5 of 64 held-out answers, teacher-forced, every other
digit in 64 of 64; in `digit 6 of 6: 4` the position of the last digit is the count that
every result carries.) When the harness asks for a summary it writes the digits read so far
and how many there are (`Digits read: 739 (3 of 6).`): what the next segment needs. With
probability `error_rate` per digit it notes a wrong one, so that episode's notes, summary and
answer carry it while its calls keep the right shape.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from libs.domains.recall.env import ENV_NAME, TOOL_NAME
from libs.envs.base import Opening
from libs.experts.record import EpisodeExpert, Expert, ExpertTurn
from libs.sft.transcript import SftCall
from proto.messages import Task, ToolResult

_REVEAL = re.compile(r"digit (\d+) of (\d+): (\d)")


class RecallEpisodeExpert(EpisodeExpert):
    """Notes each revealed digit (in its turns' text too); answers once the last one came."""

    def __init__(self, num_digits: int, error_rate: float, rng: random.Random) -> None:
        self.num_digits, self.error_rate, self.rng = num_digits, error_rate, rng
        self.digits = ""

    def observe(self, results: Sequence[ToolResult], observation: str) -> None:
        for result in results:
            found = _REVEAL.fullmatch(result.content)
            if found:
                self.digits += self._noted(found.group(3))

    def turn(self) -> ExpertTurn:
        if len(self.digits) >= self.num_digits:
            return ExpertTurn(content=self.digits)
        return ExpertTurn(content=self.digits, calls=(SftCall(TOOL_NAME, {}),))

    def summary(self) -> str:
        return f"Digits read: {self.digits} ({len(self.digits)} of {self.num_digits})."

    def _noted(self, digit: str) -> str:
        if self.rng.random() < self.error_rate:
            return str((int(digit) + self.rng.randint(1, 9)) % 10)
        return digit


class RecallExpert(Expert):
    """Demonstrations for `recall`, summaries included."""

    env = ENV_NAME

    def begin(self, task: Task, opening: Opening, rng: random.Random) -> EpisodeExpert:
        return RecallEpisodeExpert(len(str(task.spec["code"])), self.error_rate, rng)
