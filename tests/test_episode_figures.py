"""What a step record and the report say about the trained episodes: tool use and length
(libs.rollout.figures through libs.trainer.recorder), and held-out episodes rendered as text
(libs.rollout.transcripts)."""

from __future__ import annotations

from libs.rollout.transcripts import held_out_transcripts, render_episode
from libs.tokenizer import ByteTokenizer
from libs.trainer.recorder import EpisodeFields, episode_fields
from proto import messages as m
from proto.messages import Rollout, ScoredRollout, Task, Turn

TOKENIZER = ByteTokenizer()


def episode(index: int, calls: int, invalid: int, turns: int, segments: int) -> ScoredRollout:
    task = Task(task_id=f"t{index}", env="calc", prompt="", group_size=1)
    rollout = Rollout(
        rollout_id=f"t{index}.0",
        task_id=f"t{index}",
        group_id=f"t{index}",
        sample_index=0,
        env="calc",
        turns=[
            Turn(role="user", token_ids=TOKENIZER.encode("what is 2+3?")),
            Turn(role="assistant", token_ids=TOKENIZER.encode("5"), text="5", policy_version=0),
        ],
        finish_reason="stop",
        task=task,
        env_info={"answer_correct": index % 2 == 0},
        stats={
            m.EPISODE_STAT_TOOL_CALLS: float(calls),
            m.EPISODE_STAT_INVALID_TOOL_CALLS: float(invalid),
            m.EPISODE_STAT_TURNS: float(turns),
            m.EPISODE_STAT_SEGMENTS: float(segments),
        },
    )
    return ScoredRollout(rollout=rollout, reward=1.0 if index % 2 == 0 else 0.0)


def test_a_step_records_tool_call_validity_and_turns_and_segments_per_episode() -> None:
    kept = [episode(0, calls=3, invalid=1, turns=4, segments=1), episode(1, 0, 0, 1, 2)]
    assert episode_fields(kept) == EpisodeFields(
        tool_call_validity=0.75,  # 3 well-formed of 4 attempted
        turns_per_episode=2.5,
        segments_per_episode=1.5,
    )
    assert episode_fields([episode(1, 0, 0, 1, 1)]) == EpisodeFields(None, 1.0, 1.0)
    assert episode_fields([]) == EpisodeFields(None, None, None)


def test_held_out_episodes_render_each_turn_under_its_role_in_task_order() -> None:
    scored = [episode(i, 1, 0, 1, 1) for i in range(5)]
    # The prompt has no text of its own: decoded from its tokens; the answer's text as written.
    assert render_episode(scored[0].rollout, TOKENIZER) == "[user]\nwhat is 2+3?\n\n[assistant]\n5"
    kept = held_out_transcripts(scored, TOKENIZER, limit=3)
    assert [(t.task_id, t.reward, t.success) for t in kept] == [
        ("t0", 1.0, True),
        ("t1", 0.0, False),
        ("t2", 1.0, True),
    ]
    assert held_out_transcripts(scored, TOKENIZER, limit=0) == []
