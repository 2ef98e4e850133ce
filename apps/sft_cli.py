"""`rlpipe sft`: the command line of the SFT stage (libs.sft.train).

    rlpipe sft --data demos.jsonl --out models/calc-sft --steps 300
    rlpipe sft --data demos.jsonl --out models/mine --policy-path BASE   # BASE's tokenizer
    rlpipe sft --data demos.jsonl --out models/calc-sft --train-tokenizer 1024  # its own

Progress is a rich bar on a terminal and a log line every 10 steps otherwise (with the steps
per second). A malformed transcript line stops the run before training with its line number
and field (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

# The training side (torch, transformers: seconds of CPU) is imported when `rlpipe sft` runs,
# not when its flags are added to every `rlpipe` command's parser.
if TYPE_CHECKING:
    from libs.sft.train import ProgressFn, SftConfig, SftStep

LOG_EVERY_STEPS = 10
LogFn = Callable[..., None]  # (event, **fields)
log = structlog.get_logger(__name__)


def add_sft_parser(commands: Any) -> None:
    """The `sft` subcommand and its flags."""
    sft = commands.add_parser("sft", help="train a policy on chat transcripts (JSONL)")
    sft.add_argument("--data", type=Path, required=True, help="JSONL transcripts")
    sft.add_argument("--out", type=Path, required=True, help="model folder to write")
    sft.add_argument("--policy-preset", default="tiny", help="architecture when no --policy-path")
    sft.add_argument("--policy-path", default=None, help="local model folder to start from")
    sft.add_argument(
        "--tokenizer",
        default=None,
        help="'byte' or a local tokenizer folder; default: the policy folder's own, else byte",
    )
    sft.add_argument(
        "--train-tokenizer",
        type=int,
        default=None,
        metavar="VOCAB_SIZE",
        help="first train a BPE tokenizer of at most VOCAB_SIZE tokens on --data (into "
        "OUT/tokenizer) and build the --policy-preset over it (not with --policy-path or "
        "--tokenizer)",
    )
    sft.add_argument("--steps", type=int, default=300)
    sft.add_argument("--batch-size", type=int, default=8)
    sft.add_argument("--learning-rate", type=float, default=2e-3)
    sft.add_argument("--max-sequence-tokens", type=int, default=2048)
    sft.add_argument("--checkpoint-every-steps", type=int, default=50)
    sft.add_argument("--seed", type=int, default=0)
    sft.add_argument("--device", default="auto", help="cpu, cuda, or auto")
    sft.add_argument(
        "--without-system-message",
        action="store_true",
        help="train on the transcripts without their system message (a short-context first "
        "stage of a curriculum; finish with full transcripts)",
    )


def config_from_args(args: argparse.Namespace, tokenizer: str | None = None) -> SftConfig:
    """The run the flags ask for; `tokenizer` (a folder) replaces --tokenizer."""
    from libs.policy import PolicyConfig
    from libs.sft.train import SftConfig

    policy = PolicyConfig(
        preset=args.policy_preset,
        path=args.policy_path,
        tokenizer=tokenizer or args.tokenizer,
        device=args.device,
    )
    return SftConfig(
        data=args.data,
        out=args.out,
        policy=policy,
        steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        max_sequence_tokens=args.max_sequence_tokens,
        checkpoint_every_steps=args.checkpoint_every_steps,
        seed=args.seed,
        without_system_message=args.without_system_message,
    )


def trained_tokenizer(args: argparse.Namespace) -> str | None:
    """The folder of the tokenizer `--train-tokenizer` asks for (trained on the data once),
    or None without the flag."""
    if args.train_tokenizer is None:
        return None
    if args.policy_path or args.tokenizer:
        raise ValueError(
            "--train-tokenizer builds a new policy over a new tokenizer: drop --policy-path "
            "and --tokenizer, or drop --train-tokenizer"
        )
    from libs.sft.tokenizer import ensure_transcript_tokenizer

    folder = ensure_transcript_tokenizer(args.data, args.out / "tokenizer", args.train_tokenizer)
    return str(folder)


def run(args: argparse.Namespace) -> int:
    """Train; print the result as one JSON line on stdout."""
    from libs.sft.transcript import TranscriptError

    try:
        config = config_from_args(args, trained_tokenizer(args))
        result = run_with_progress(config)
    except (TranscriptError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(config.out), **result}))
    return 0


def run_with_progress(
    config: SftConfig, title: str = "sft", emit: LogFn | None = None
) -> dict[str, Any]:
    """`train_sft` with a rich bar on a terminal, log lines otherwise (through `emit`, e.g.
    the demo launcher's own log, whose library loggers are kept to warnings)."""
    from libs.sft.train import train_sft

    if not sys.stderr.isatty():
        return train_sft(config, log_progress(config, title, emit or log.info))
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"))
    with Progress(*columns, TimeRemainingColumn(), transient=False) as bar:
        task = bar.add_task(title, total=config.steps, info="")

        def on_step(step: SftStep) -> None:
            info = f"step {step.step}/{config.steps} loss {step.loss:.3f}"
            bar.update(task, completed=step.step, info=info)

        return train_sft(config, on_step)


def log_progress(config: SftConfig, title: str, emit: LogFn) -> ProgressFn:
    """A line every LOG_EVERY_STEPS steps and at the last, with the steps per second since
    the line before (the first line: since the first step, past the model's loading)."""
    mark: list[float] = []  # step and monotonic time of the last line, or of the first step

    def on_step(step: SftStep) -> None:
        now = time.monotonic()
        if not mark:
            mark[:] = [step.step, now]
        if step.step % LOG_EVERY_STEPS == 0 or step.step == config.steps:
            rate = (step.step - mark[0]) / (now - mark[1]) if now > mark[1] else None
            emit(
                f"{title} step",
                step=step.step,
                steps=config.steps,
                loss=round(step.loss, 4),
                confident_tokens=round(step.confident_tokens, 3),
                learning_rate=round(step.learning_rate, 6),
                steps_per_s=None if rate is None else round(rate, 2),
            )
            mark[:] = [step.step, now]

    return on_step
