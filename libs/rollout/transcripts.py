"""Episodes as a person reads them: each turn's role and text, one after another.

    text = render_episode(scored.rollout, tokenizer)
    kept = held_out_transcripts(scored_episodes, tokenizer, limit=3)   # the eval gate's

A turn's text is what the harness decoded (Turn.text); a turn without it (a prompt fed as
tokens) is decoded from its tokens. The eval gate keeps the first few held-out episodes of
each decision (the same tasks every time), so `rlpipe report` can set the first evaluated
version's episodes beside the last's: what the policy learned to do, in its own words.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from libs.rollout.figures import is_success
from libs.tokenizer import Tokenizer
from proto.messages import Rollout, ScoredRollout


class EpisodeText(msgspec.Struct, kw_only=True, frozen=True):
    """One episode as a person reads it: its task, verdict and text."""

    task_id: str
    reward: float
    success: bool
    text: str


def render_episode(rollout: Rollout, tokenizer: Tokenizer) -> str:
    """The episode's turns as `[role]` headers followed by their text."""
    blocks = []
    for turn in rollout.turns:
        text = turn.text or tokenizer.decode(turn.token_ids)
        blocks.append(f"[{turn.role}]\n{text.strip()}")
    return "\n\n".join(blocks)


def held_out_transcripts(
    scored: Sequence[ScoredRollout], tokenizer: Tokenizer, limit: int
) -> list[EpisodeText]:
    """The first `limit` episodes of `scored` (held-out tasks, in task order) rendered."""
    return [
        EpisodeText(
            task_id=s.rollout.task_id,
            reward=s.reward,
            success=is_success(s),
            text=render_episode(s.rollout, tokenizer),
        )
        for s in scored[:limit]
    ]
