"""Held-out episodes before and after: the eval gate's first evaluated version beside its last.

    path = write_transcripts(run_dir, out_dir)   # out_dir/transcripts.md; None: none recorded

The eval gate writes the first few held-out episodes of each decision (the same tasks each
time: `trainer.eval.transcripts`, libs.rollout.transcripts) to trainer/eval_transcripts.jsonl.
The page sets, task by task, the episode of the first version evaluated beside the one of
the last, with each one's reward and verdict.
"""

from __future__ import annotations

from pathlib import Path

from libs.trainer.metrics import TranscriptRecord, read_transcripts

PAGE = "transcripts.md"


def before_after(
    records: list[TranscriptRecord],
) -> tuple[list[TranscriptRecord], list[TranscriptRecord]]:
    """The first evaluated version's episodes and the last one's (by record order)."""
    if not records:
        return [], []
    first, last = records[0].version, records[-1].version
    return [r for r in records if r.version == first], [r for r in records if r.version == last]


def transcripts_page(records: list[TranscriptRecord]) -> str:
    """Markdown: per held-out task, its episode at the first and at the last version."""
    before, after = before_after(records)
    later = {r.task_id: r for r in after}
    first, last = before[0], after[-1]
    lines = [
        "# Held-out episodes, before and after",
        "",
        f"Policy version {first.version} (step {first.step}) against version {last.version} "
        f"(step {last.step}), greedy, as the eval gate ran them.",
    ]
    for episode in before:
        lines += [*([""] if lines[-1] else []), f"## Task {episode.task_id}", ""]
        pair = [("Before", episode), ("After", later.get(episode.task_id))]
        for label, record in pair:
            if record is None:
                lines += [f"{label}: not recorded", ""]
                continue
            verdict = "solved" if record.success else "not solved"
            lines += [
                f"{label}: version {record.version}, reward {record.reward:.2f}, {verdict}",
                "",
                "```text",
                record.text,
                "```",
                "",
            ]
    return "\n".join(lines).rstrip() + "\n"


def write_transcripts(run_dir: Path, out_dir: Path) -> Path | None:
    """Write the page into `out_dir`; None when the run recorded no held-out episode."""
    records = read_transcripts(run_dir)
    if not records:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PAGE
    path.write_text(transcripts_page(records))
    return path


def transcripts_line(run_dir: Path, out_dir: Path) -> str | None:
    """Write the page; the summary's line saying where it is (None: nothing recorded)."""
    path = write_transcripts(run_dir, out_dir)
    if path is None:
        return None
    before, after = before_after(read_transcripts(run_dir))
    return (
        f"transcripts: {path} ({len(before)} held-out tasks at version {before[0].version} "
        f"and {after[0].version})"
    )
