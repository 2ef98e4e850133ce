"""`rlpipe domain`: the domains this process knows, their demonstrations, and a policy's
level on one of them, all in this process (no services).

    rlpipe domain list
    rlpipe domain demos --env calc --num-tasks 400 --error-rate 0.1 --out calc.jsonl
    rlpipe domain evaluate --policy-path models/calc-sft --env calc --num-tasks 32

`list` prints one line per domain: name, folder, expert (yes/no), recipe (its path or -).
`demos` records a domain's scripted expert through its environment under its harness
limits (libs.experts.demos); `evaluate` runs held-out episodes of a policy under the same
limits (libs.sft.evaluate) and prints the figures as one JSON line. Domains of your own
come from RLPIPE_DOMAIN_PATHS (docs/domains.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any


def add_domain_parser(commands: Any) -> None:
    """Register `domain` and its subcommands on an argparse subparsers object."""
    parser = commands.add_parser("domain", help="list domains, record demonstrations, evaluate")
    subcommands = parser.add_subparsers(dest="domain_command", required=True)
    subcommands.add_parser("list", help="the known domains: name, folder, expert, recipe")
    # Unset flags take libs.experts.demos.DemoConfig's defaults (imported when it runs).
    demos = subcommands.add_parser("demos", help="a scripted expert's episodes as SFT JSONL")
    demos.add_argument("--env", help="a domain with a scripted expert (default: calc)")
    demos.add_argument("--num-tasks", type=int)
    demos.add_argument("--error-rate", type=float, help="chance of a slip per decision")
    demos.add_argument("--difficulty", type=int)
    demos.add_argument("--seed", type=int)
    demos.add_argument("--tokenizer", help="'byte' or a tokenizer folder")
    demos.add_argument("--out", type=Path, required=True)
    evaluate = subcommands.add_parser("evaluate", help="a policy's held-out figures on a domain")
    evaluate.add_argument("--policy-path", default=None)
    evaluate.add_argument(
        "--tokenizer", default=None, help="'byte' or a folder; default: the model folder's own"
    )
    evaluate.add_argument("--env", default="calc")
    evaluate.add_argument("--num-tasks", type=int, default=32)
    evaluate.add_argument(
        "--group-size", type=int, default=1,
        help="samples a task; above 1 the figures count the tasks solved always, never, sometimes",
    )  # fmt: skip
    evaluate.add_argument("--difficulty", type=int, default=0)
    evaluate.add_argument("--temperature", type=float, default=1.0)
    evaluate.add_argument("--no-summarize", action="store_true")
    evaluate.add_argument("--device", default="cpu", help='torch device: "cpu", "cuda", "cuda:1"')
    evaluate.add_argument(
        "--engine", default="hf", choices=("hf", "paged"), help="paged: a CUDA device's engine"
    )


def run(args: argparse.Namespace) -> int:
    commands = {"list": list_domains, "demos": write_demos, "evaluate": evaluate_policy}
    return commands[args.domain_command](args)


def list_domains(args: argparse.Namespace) -> int:
    from libs.domains.registry import domains

    for name, found in sorted(domains().items()):
        recipe = found.recipe_path if found.recipe_path.is_file() else "-"
        expert = "yes" if found.expert is not None else "no"
        print(f"{name}\t{found.folder}\texpert={expert}\trecipe={recipe}")
    return 0


def write_demos(args: argparse.Namespace) -> int:
    from libs.experts.demos import DemoConfig, write_demonstrations

    given = {
        "env": args.env,
        "num_tasks": args.num_tasks,
        "error_rate": args.error_rate,
        "difficulty": args.difficulty,
        "seed": args.seed,
        "tokenizer": args.tokenizer,
    }
    config = DemoConfig(**{name: value for name, value in given.items() if value is not None})
    stats = asyncio.run(write_demonstrations(config, args.out))
    print(json.dumps({"out": str(args.out), **stats.as_dict()}))
    return 0


def evaluate_policy(args: argparse.Namespace) -> int:
    from libs.chat.template import chat_template_for
    from libs.domains.registry import harness_for
    from libs.engine.factory import EngineConfig, build_engine
    from libs.policy import PolicyConfig, load_policy_tokenizer
    from libs.sft.evaluate import measure

    policy = PolicyConfig(path=args.policy_path, tokenizer=args.tokenizer, device=args.device)
    engine = build_engine(EngineConfig(type=args.engine), policy)
    tokenizer = load_policy_tokenizer(policy)
    agent = harness_for(args.env, chat_template_for(tokenizer))
    if args.no_summarize:
        agent = agent.model_copy(update={"summarize": False})
    figures = asyncio.run(
        measure(
            engine,
            tokenizer,
            args.env,
            num_tasks=args.num_tasks,
            group_size=args.group_size,
            difficulty=args.difficulty,
            temperature=args.temperature,
            agent=agent,
        )
    )
    print(json.dumps({"env": args.env, "summarize": agent.summarize, **figures}))
    return 0
