"""Scripted expert of the `functions` domain: read the stub, write the function, run the
visible tests, answer.

It plays the task's reference through the sandbox's tools, as a careful programmer would:
`read_file` of solution.py, `write_file` of the solved file, `run_tests`, then a final reply.
With probability `error_rate` per episode it slips on one constant of the prompt (a number off
by one or two, another letter or separator: families.py `slipped`), writes that and answers
anyway, so its demonstrations fail the hidden tests the way a careless policy does, through
valid calls; RL is what removes the slips.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from libs.domains.functions.families import Params
from libs.domains.functions.tasks import ENV_NAME, parse_spec
from libs.envs.base import Opening
from libs.experts.record import EpisodeExpert, Expert, ExpertTurn
from libs.sft.transcript import SftCall
from proto.messages import Task, ToolResult

SOLUTION_FILE = "solution.py"


class FunctionsEpisodeExpert(EpisodeExpert):
    """Three tool turns, then the answer."""

    def __init__(self, fn: str, source: str) -> None:
        self.turns = [
            ExpertTurn(calls=(SftCall("read_file", {"path": SOLUTION_FILE}),)),
            ExpertTurn(calls=(SftCall("write_file", {"path": SOLUTION_FILE, "content": source}),)),
            ExpertTurn(calls=(SftCall("run_tests", {}),)),
            ExpertTurn(content=f"Done: `{fn}` is implemented in {SOLUTION_FILE}."),
        ]

    def observe(self, results: Sequence[ToolResult], observation: str) -> None:
        """The script does not depend on what the tools answer."""

    def turn(self) -> ExpertTurn:
        return self.turns.pop(0)


class FunctionsExpert(Expert):
    """Demonstrations for `functions`."""

    env = ENV_NAME

    def begin(self, task: Task, opening: Opening, rng: random.Random) -> EpisodeExpert:
        parsed = parse_spec(task.spec)
        if parsed is None:
            raise ValueError(f"functions task {task.task_id}: its spec names no family's task")
        family, params = parsed
        written: Params = params
        if rng.random() < self.error_rate:
            written = family.slipped(params, rng)
        return FunctionsEpisodeExpert(params["fn"], family.reference(written))
