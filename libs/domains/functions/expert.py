"""Scripted expert of the `functions` domain: read the stub, write the function, run the
visible tests, answer.

It plays the task's reference through the sandbox's tools, as a careful programmer would:
`read_file` of solution.py, `write_file` of the solved file, `run_tests`, then a final reply.
With probability `error_rate` per episode it slips on one constant of the prompt (a number off
by one or two, another letter or separator: families.py `slipped`) and writes that. When the
visible tests then fail, it fixes the file (writes the reference and runs the tests again)
in RECOVERY_RATE of those episodes and answers anyway in the others, so its demonstrations
fail the hidden tests the way a careless policy does, through valid calls, and show the
recovery without always making it; RL is what removes the slips and makes the fix a habit.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from libs.domains.functions.tasks import ENV_NAME, parse_spec
from libs.envs.base import Opening
from libs.experts.record import EpisodeExpert, Expert, ExpertTurn
from libs.sft.transcript import SftCall
from proto.messages import Task, ToolResult

SOLUTION_FILE = "solution.py"
# Of the slipped episodes whose visible tests fail, those the expert fixes. Demonstrations
# that never went past a failing test taught agent-75m to answer after one, leaving RL no fix
# to reinforce (held-out +0.06 at best in 280 s of RL on an H200; with fixes, +0.07 in 250 s:
# bench/results/h200/agent_functions.json).
RECOVERY_RATE = 0.5


class FunctionsEpisodeExpert(EpisodeExpert):
    """Three tool turns, then the answer; with `fix` (the reference, after a slip), two more
    turns (write it, run the tests) when the visible tests failed."""

    def __init__(self, fn: str, source: str, fix: str | None = None) -> None:
        self.turns = [
            ExpertTurn(calls=(SftCall("read_file", {"path": SOLUTION_FILE}),)),
            _write(source),
            ExpertTurn(calls=(SftCall("run_tests", {}),)),
            ExpertTurn(content=f"Done: `{fn}` is implemented in {SOLUTION_FILE}."),
        ]
        self.fix = fix

    def observe(self, results: Sequence[ToolResult], observation: str) -> None:
        """After a failed `run_tests`, the fix (once) before the answer."""
        failed = any(r.name == "run_tests" and r.error for r in results)
        if failed and self.fix is not None:
            self.turns[:0] = [_write(self.fix), ExpertTurn(calls=(SftCall("run_tests", {}),))]
            self.fix = None

    def turn(self) -> ExpertTurn:
        return self.turns.pop(0)


def _write(source: str) -> ExpertTurn:
    return ExpertTurn(calls=(SftCall("write_file", {"path": SOLUTION_FILE, "content": source}),))


class FunctionsExpert(Expert):
    """Demonstrations for `functions`."""

    env = ENV_NAME

    def begin(self, task: Task, opening: Opening, rng: random.Random) -> EpisodeExpert:
        parsed = parse_spec(task.spec)
        if parsed is None:
            raise ValueError(f"functions task {task.task_id}: its spec names no family's task")
        family, params = parsed
        reference = family.reference(params)
        if rng.random() >= self.error_rate:
            return FunctionsEpisodeExpert(params["fn"], reference)
        slipped = family.reference(family.slipped(params, rng))
        fix = reference if rng.random() < RECOVERY_RATE else None
        return FunctionsEpisodeExpert(params["fn"], slipped, fix)
