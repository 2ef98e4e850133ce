"""Datasets as tasks: rows of a JSONL or parquet file, malformed rows refused by line and
field, every row served once per pass, answers scored exact / numeric / regex / by a user's
criterion through the reward rubric.

Run: .venv/bin/python -m pytest tests/test_dataset_env.py -q
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from libs.domains.dataset.env import DatasetConfig, DatasetEnv, DatasetError, load_rows
from libs.domains.registry import make_env, rubric_for
from libs.nats_server import NatsServer, free_port
from libs.reward import score_rollout
from libs.trainer.checkpoint import checkpoint_version
from proto.messages import Rollout, Task, Turn
from tests.marks import E2E

ROWS = [
    {"prompt": "12+30=", "answer": 42},
    {"prompt": "Capital of France?", "answer": "Paris", "metadata": {"topic": "geo"}},
    {"prompt": "Say a date", "answer": r"\d{4}-\d{2}-\d{2}"},
]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_rows_are_read_from_jsonl_and_parquet(tmp_path: Path) -> None:
    jsonl = write_jsonl(tmp_path / "rows.jsonl", [json.dumps(row) for row in ROWS] + [""])
    rows = load_rows(jsonl)
    assert [(r.prompt, r.answer) for r in rows] == [
        ("12+30=", "42"),
        ("Capital of France?", "Paris"),
        ("Say a date", r"\d{4}-\d{2}-\d{2}"),
    ]
    assert rows[1].metadata == {"topic": "geo"}

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["7=", "8="], "answer": ["7", "8"]})
    pq.write_table(table, tmp_path / "rows.parquet")
    assert [r.answer for r in load_rows(tmp_path / "rows.parquet")] == ["7", "8"]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"prompt": "a", "answer": "b"}', '{"prompt": "c"'], "line 2: not valid JSON"),
        (
            ['{"prompt": "a", "answer": "b"}', "", '{"prompt": "c"}'],
            "line 3: field 'answer' is missing",
        ),
        (
            ['{"promt": "a", "answer": "b"}'],
            "line 1: unknown field 'promt' (did you mean 'prompt'?)",
        ),
        (
            ['{"prompt": 5, "answer": "b"}'],
            "line 1: field 'prompt' must be a non-empty string (got int '5')",
        ),
        (['{"prompt": "a", "answer": true}'], "line 1: field 'answer' must be text or a number"),
        (
            ['{"prompt": "a", "answer": "b", "metadata": [1]}'],
            "line 1: field 'metadata' must be an object",
        ),
        (['["a", "b"]'], "line 1: expected an object with prompt and answer"),
    ],
)
def test_a_malformed_line_is_refused_naming_line_and_field(
    tmp_path: Path, lines: list[str], message: str
) -> None:
    path = write_jsonl(tmp_path / "rows.jsonl", lines)
    with pytest.raises(DatasetError) as refused:
        load_rows(path)
    assert str(refused.value).startswith(f"dataset {path}: {message}")


def test_parquet_without_pyarrow_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "rows.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if absent
    with pytest.raises(DatasetError, match=r"needs pyarrow: pip install 'rlpipe\[parquet\]'"):
        load_rows(tmp_path / "rows.parquet")


def test_every_row_is_served_once_per_pass_in_a_seeded_order(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "rows.jsonl", [json.dumps({"prompt": f"{i}=", "answer": i}) for i in range(10)]
    )
    env = DatasetEnv(DatasetConfig(path=path, match="numeric"))
    source = env.task_source(difficulty=0, group_size=4, seed=3)
    first = [source.task(i) for i in range(20)]
    assert sorted(t.spec["row"] for t in first[:10]) == list(range(10))
    assert sorted(t.spec["row"] for t in first[10:]) == list(range(10))
    assert [t.spec["row"] for t in first[:10]] != [t.spec["row"] for t in first[10:]]
    again = DatasetEnv(DatasetConfig(path=path)).task_source(difficulty=0, group_size=4, seed=3)
    assert again.task(13).prompt == first[13].prompt and first[13].group_size == 4
    assert first[0].spec["match"] == "numeric" and first[0].env == "dataset"
    with pytest.raises(ValueError, match="RLPIPE_ENV_GATEWAY_DATASET_PATH"):
        make_env("dataset").task_source(difficulty=0, group_size=4, seed=0)


def answered(task: Task, text: str) -> Rollout:
    return Rollout(
        rollout_id="r1",
        task_id=task.task_id,
        group_id=task.task_id,
        sample_index=0,
        env="dataset",
        turns=[
            Turn(role="user", token_ids=list(task.prompt.encode()), text=task.prompt),
            Turn(
                role="assistant",
                token_ids=list(text.encode()),
                text=text,
                logprobs=[-1.0] * len(text.encode()),
                policy_version=0,
            ),
        ],
        finish_reason="stop",
        task=task,
    )


def task(answer: str, match: str) -> Task:
    spec = {"answer": answer, "match": match, "row": 0, "max_tokens": 8, "metadata": {}}
    return Task(task_id="dataset-s0-0", env="dataset", prompt="q", group_size=1, spec=spec)


def length_criterion(rollout: Rollout, task: Task) -> tuple[float, str]:
    """A user's criterion: half credit per character up to 2."""
    text = rollout.turns[-1].text
    return min(len(text), 2) / 2, f"{len(text)} characters"


@pytest.mark.parametrize(
    ("answer", "match", "text", "reward"),
    [
        ("Paris", "exact", "  paris ", 1.0),
        ("Paris", "exact", "Paris, France", 0.0),
        ("1234", "numeric", "It is 1,234.0", 1.0),
        ("0.5", "numeric", "about 1/2 = 0.5000001", 1.0),
        ("42", "numeric", "41 or 43", 0.0),
        ("42", "numeric", "no idea", 0.0),
        (r"\d{4}-\d{2}-\d{2}", "regex", " 2024-01-31\n", 1.0),
        (r"\d{4}-\d{2}-\d{2}", "regex", "31/01/2024", 0.0),
        ("", "tests.test_dataset_env:length_criterion", "a", 0.5),
    ],
)
async def test_answers_are_scored_as_the_task_says(
    answer: str, match: str, text: str, reward: float
) -> None:
    the_task = task(answer or "x", match)
    scored = await score_rollout(rubric_for("dataset"), answered(the_task, text), the_task, now=0.0)
    assert scored.reward == pytest.approx(reward), scored.criteria


def test_an_unknown_match_or_missing_function_is_refused(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "rows.jsonl", [json.dumps(ROWS[0])])
    with pytest.raises(ValueError, match="use exact, numeric, regex or module:function"):
        DatasetConfig(path=path, match="fuzzy")
    with pytest.raises(ValueError, match=r"tests.test_dataset_env:nope.*cannot import"):
        DatasetConfig(path=path, match="tests.test_dataset_env:nope")


# --- through the real commands ---------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent


def rlpipe(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")}
    return subprocess.run(
        [sys.executable, "-m", "apps.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_demo_refuses_a_malformed_dataset_naming_line_and_field(tmp_path: Path) -> None:
    rows = write_jsonl(
        tmp_path / "rows.jsonl", ['{"prompt": "1=", "answer": 1}', '{"prompt": "2="}']
    )
    result = rlpipe("demo", "--dataset", str(rows), "--run-dir", str(tmp_path / "run"), timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: dataset {rows}: line 2: field 'answer' is missing"
    ]
    assert not (tmp_path / "run").exists()  # refused before anything started


@E2E
def test_the_demo_trains_on_a_dataset_to_the_exact_step_and_leaves_a_checkpoint(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    rows = write_jsonl(
        tmp_path / "rows.jsonl", [json.dumps({"prompt": f"{d}=", "answer": d}) for d in range(10)]
    )
    run_dir = tmp_path / "run"
    overrides = [
        "trainer.batch_groups=2",
        "trainer.checkpoint_every_steps=1",
        "trainer.checkpoint_keep=1",
        "env-gateway.group_size=4",
        "env-gateway.dataset_max_tokens=3",
    ]
    result = rlpipe(
        "demo",
        "--dataset",
        str(rows),
        "--dataset-match",
        "numeric",
        "--max-trainer-steps",
        "3",
        "--run-dir",
        str(run_dir),
        "--services",
        "trainer,rollout-worker,env-gateway,reward,weight-broadcaster",
        *(arg for o in overrides for arg in ("--set", o)),
        timeout=400,
    )
    try:
        assert result.returncode == 0, result.stderr[-3000:]
        summary = json.loads(result.stdout.strip().splitlines()[-1])
        assert summary["stop_reason"] == "max_trainer_steps"
        assert summary["trainer_step"] == 3  # exactly the bound
        steps = [json.loads(line) for line in (run_dir / "trainer" / "steps.jsonl").open()]
        assert [s["step"] for s in steps] == [1, 2, 3]
        # --set reached the trainer: 2 groups of 4 per step, one checkpoint kept.
        assert all(s["num_groups"] == 2 for s in steps), steps
        [checkpoint] = list((run_dir / "trainer" / "checkpoints").glob("step-*"))
        assert checkpoint.name == "step-00000003"
        # The rows were the tasks: the gateway fed env 'dataset', the reward service scored it.
        samples = [json.loads(line) for line in (run_dir / "trainer" / "step_samples.jsonl").open()]
        ids = [sample for step in samples for sample in step["sample_ids"]]
        assert len(ids) == 24 and all(i.startswith("dataset-s0-") for i in ids), ids
        reward_log = (run_dir / "logs" / "reward.log").read_text()
        assert '"env": "dataset", "criteria": {"correct": 1.0}' in reward_log
    finally:
        kill_recorded(run_dir)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert tokenizer.encode("7=", add_special_tokens=False) == list(b"7=")
    AutoModelForCausalLM.from_pretrained(checkpoint)
    served = serve_checkpoint(checkpoint, nats_server, tmp_path)
    assert served == checkpoint_version(checkpoint) and served is not None and served >= 3


def serve_checkpoint(folder: Path, nats: NatsServer, tmp_path: Path) -> int:
    """The policy version a fixed replica serving `folder` puts on its answers."""
    port, health = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")}
    env |= {
        "RLPIPE_NATS_URL": nats.url,
        "RLPIPE_RUN_DIR": str(tmp_path / "serve"),
        "RLPIPE_ROLLOUT_WORKER_HTTP_PORT": str(health),
        "RLPIPE_ROLLOUT_WORKER_SERVE_PORT": str(port),
        "RLPIPE_ROLLOUT_WORKER_CONSUME_TASKS": "false",
        "RLPIPE_ROLLOUT_WORKER_FOLLOW_WEIGHTS": "false",
        "RLPIPE_ROLLOUT_WORKER_POLICY_PATH": str(folder),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "apps.cli", "run", "rollout-worker"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        body = json.dumps({"model": "rlpipe-policy", "prompt": "7=", "max_tokens": 2}).encode()
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, "the serving replica exited"
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                data=body,
                headers={"content-type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    version: int = json.loads(response.read())["choices"][0]["policy_version"]
                    return version
            except OSError:
                assert time.monotonic() < deadline, "the replica did not answer within 120 s"
                time.sleep(0.5)
    finally:
        process.terminate()
        process.wait(timeout=30)


def kill_recorded(run_dir: Path) -> None:
    """After a failed run: SIGKILL the process groups the launcher recorded, if any lives."""
    if not (run_dir / "pids.json").exists():
        return
    pids = json.loads((run_dir / "pids.json").read_text())
    for pid in [*pids["nats"], *(p for group in pids["services"].values() for p in group)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
