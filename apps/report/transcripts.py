"""Held-out episodes before and after: the eval gate's first evaluated version beside its last.

    line = transcripts_line(run_dir, out_dir)   # writes out_dir/transcripts.md; None: none recorded

The eval gate writes the first few held-out episodes of each decision (the same tasks each
time: `trainer.eval.transcripts`, libs.rollout.transcripts) to trainer/eval_transcripts.jsonl.
The page sets, task by task, the episode of the first version evaluated beside the one of
the last, with each one's reward and verdict.
"""

from __future__ import annotations

from pathlib import Path

from libs.trainer.metrics import TranscriptRecord, read_transcripts

PAGE = "transcripts.md"


BeforeAfter = tuple[TranscriptRecord, TranscriptRecord | None]


def before_after(records: list[TranscriptRecord]) -> list[BeforeAfter]:
    """Each episode of the first evaluated version with the same task's at the last one
    (None: the last decision did not record that task)."""
    if not records:
        return []
    first, last = records[0].version, records[-1].version
    later = {r.episode.task_id: r for r in records if r.version == last}
    return [(r, later.get(r.episode.task_id)) for r in records if r.version == first]


def transcripts_page(pairs: list[BeforeAfter], last: TranscriptRecord) -> str:
    """Markdown: per held-out task, its episode at the first and at the `last` version."""
    first = pairs[0][0]
    lines = [
        "# Held-out episodes, before and after",
        "",
        f"Policy version {first.version} (step {first.step}) against version {last.version} "
        f"(step {last.step}), greedy, as the eval gate ran them.",
    ]
    for before, after in pairs:
        lines += [*([""] if lines[-1] else []), f"## Task {before.episode.task_id}", ""]
        for label, record in (("Before", before), ("After", after)):
            if record is None:
                lines += [f"{label}: not recorded", ""]
                continue
            episode = record.episode
            verdict = "solved" if episode.success else "not solved"
            lines += [
                f"{label}: version {record.version}, reward {episode.reward:.2f}, {verdict}",
                "",
                "```text",
                episode.text,
                "```",
                "",
            ]
    return "\n".join(lines).rstrip() + "\n"


def transcripts_line(run_dir: Path, out_dir: Path) -> str | None:
    """Write the page into `out_dir`; the summary's line saying where it is (None: the run
    recorded no held-out episode)."""
    records = read_transcripts(run_dir)
    if not records:
        return None
    pairs = before_after(records)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PAGE
    path.write_text(transcripts_page(pairs, records[-1]))
    return (
        f"transcripts: {path} ({len(pairs)} held-out tasks at version {pairs[0][0].version} "
        f"and {records[-1].version})"
    )
