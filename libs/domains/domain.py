"""What a domain is: the parts of one kind of task that live together in its folder.

    DOMAIN = Domain(
        name="calc",
        folder=Path(__file__).parent,
        env=CalcEnv,                 # opens episodes, generates tasks (libs.envs.base)
        rubric=calc_rubric,          # scores its rollouts (libs.reward.rubric)
        expert=CalcExpert,           # scripted demonstrations, for a warm start (optional)
        harness=calc_harness,        # the harness limits its episodes are made for (optional)
    )

A domain folder is a Python package whose `__init__.py` defines `DOMAIN`; the registry
(libs.domains.registry) finds it there. `recipe.toml` beside it, when present, is the
domain's demo recipe (settings tables read by libs.settings).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from libs.chat.template import ChatTemplate
from libs.envs.base import Environment
from libs.experts.record import Expert
from libs.reward.rubric import Rubric
from libs.rollout.agent import AgentSettings

RECIPE_FILE = "recipe.toml"
_BAD_NAME_CHARS = ".*> \t\r\n"


def worker_harness(template: ChatTemplate) -> AgentSettings:
    """The rollout-worker's default harness limits: for domains that ask for nothing else."""
    return AgentSettings()


@dataclass(frozen=True)
class Domain:
    """One domain: its environment, rubric, harness limits and (optionally) expert.

    `env` is None for a domain whose environment is a process of its own speaking the wire
    protocol (docs/environments.md): env-gateway leaves its subjects to that process, and
    the domain brings the rest (its rubric, harness limits). `harness` takes the policy's
    chat template because token budgets are counted in the policy's own tokens. Everyone who
    rolls the domain out (the workers through the demo's recipe, the eval gate,
    demonstrations, the SFT evaluation) asks it for its limits.
    """

    name: str
    folder: Path
    env: Callable[[], Environment] | None
    rubric: Callable[[], Rubric]
    harness: Callable[[ChatTemplate], AgentSettings] = worker_harness
    expert: Callable[[float], Expert] | None = None

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in _BAD_NAME_CHARS):
            raise ValueError(f"domain name {self.name!r}: use letters, digits, '-' or '_' only")

    @property
    def recipe_path(self) -> Path:
        """Where the domain's demo recipe lives (the file may not exist)."""
        return self.folder / RECIPE_FILE
