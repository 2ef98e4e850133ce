"""Where a benchmark writes its result: bench/results/<machine>/<benchmark>.json.

One JSON per benchmark and machine, overwritten by the next run (its history is git's); run
folders and logs go under runs/ or a temporary folder, never into the tree. The machine is
$BENCH_MACHINE when set, else the CUDA card's model for a GPU benchmark (`NVIDIA H200` ->
h200), else `vm`, the 2-core VM the CPU figures come from.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def machine(card: str | None = None) -> str:
    """The results folder's name for this machine (`card`: the CUDA device's name, if used)."""
    if name := os.environ.get("BENCH_MACHINE"):
        return name
    if not card or card.startswith("cpu"):
        return "vm"
    model = re.search(r"\b[A-Z]+\d+\b", card)  # "NVIDIA H100 80GB HBM3" -> H100
    return (model.group(0) if model else card.split()[-1]).lower()


def result_file(benchmark: str, card: str | None = None) -> Path:
    """bench/results/<machine>/<benchmark>.json, its folder created."""
    path = RESULTS / machine(card) / f"{benchmark}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def git_commit() -> str:
    """The short hash of the commit the benchmark ran at: the checkout's, else
    $RLPIPE_GIT_COMMIT (a copy without .git, such as an archive unpacked on a GPU host), else
    ""."""
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=RESULTS.parent, capture_output=True, text=True
    )
    return done.stdout.strip() or os.environ.get("RLPIPE_GIT_COMMIT", "")


def result_json(document: object) -> str:
    """`document` as indented JSON with every list of numbers (or of number pairs) on one
    line: a curve of hundreds of points takes a line, not a thousand."""
    text = json.dumps(document, indent=2)
    number = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|null"
    pair = rf"\[\s*(?:{number})\s*,\s*(?:{number})\s*\]"
    flat = re.compile(rf"\[\s*((?:(?:{number})\s*,\s*)*(?:{number}))\s*\]")
    text = re.sub(pair, lambda m: re.sub(r"\s+", "", m.group(0)).replace(",", ", "), text)
    pairs = re.compile(rf"\[\s*((?:{pair}\s*,\s*)*{pair})\s*\]")
    text = pairs.sub(lambda m: "[" + re.sub(r"\]\s*,\s*\[", "], [", m.group(1).strip()) + "]", text)
    return flat.sub(lambda m: "[" + re.sub(r"\s*,\s*", ", ", m.group(1)) + "]", text) + "\n"
