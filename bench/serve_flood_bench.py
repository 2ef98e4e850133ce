"""Serve mode flooded while the demo trains on the same worker: does training go on?

    python bench/serve_flood_bench.py [--window-s 30] [--rounds 6] [--flood 64] [--slow 200]

Runs `rlpipe demo` (arith, on the open bus: the bus has no role for a worker that both rolls
out and records served generations) with serve mode on the rollout-worker (a key, the default
limits). Once the API answers and `--warm-s` passed, it measures `--rounds` pairs of windows
of `--window-s` seconds, one quiet and one flooded, in turn and in alternating order (quiet
first, then flooded first: the machine's other load and the run's drift fall on both alike):
trainer steps ended in each (trainer/steps.jsonl), the worker's weight swaps (/healthz), CPU
seconds of every process. In a flooded window:
- `--flood` (64) clients send n=16 completions with max_tokens at the cap (2,048),
  temperature 2 and 16 stop strings (the most allowed), again as soon as answered, after
  Retry-After on a 429;
- first, as many requests at once with 1,000 stop strings (each a 400 naming the limit);
- `--slow` (200) clients each send half a request head and hold it, reconnecting when the
  server closes them (how long each was held: the header deadline);
then the flood's clients disconnect: seconds until nothing of theirs runs or waits (/healthz).
After the windows: `--probes` single long requests, each disconnected once in the engine
(the same figure), and SIGTERM to the worker under 4 long requests (seconds to exit, its
drain from its log, what the 4 clients got). The flood's clients are plain sockets in this
process at nice 10: they stand for clients on other machines, so their CPU is not the
demo's. Figures: bench/results/vm/serve_flood.json (bench/result_file.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from result_file import git_commit, result_file, result_json

from libs.nats_server import free_port

REPO = Path(__file__).resolve().parent.parent
MAX_TOKENS = 2048  # serve.max_tokens' default
PROMPT = "Reply with a long story about numbers: 12+30="


@dataclass
class Replica:
    """The demo's rollout-worker as the bench sees it."""

    serve_url: str
    health_url: str
    key: str
    pid: int
    http: httpx.AsyncClient

    def body(self, **extra: Any) -> dict[str, Any]:
        """n=16 at the max_tokens cap, temperature 2 (the most allowed: the trained policy
        rarely samples its end token then, so a choice runs long)."""
        return {"prompt": PROMPT, "n": 16, "max_tokens": MAX_TOKENS, "temperature": 2.0} | extra

    async def post(self, body: dict[str, Any]) -> httpx.Response:
        headers = {"authorization": f"Bearer {self.key}"}
        return await self.http.post(f"{self.serve_url}/v1/completions", json=body, headers=headers)

    async def health(self) -> dict[str, Any]:
        health: dict[str, Any] = (await self.http.get(self.health_url)).json()
        return health


@dataclass
class FloodStats:
    statuses: dict[str, int] = field(default_factory=dict)
    answered_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0

    def count(self, status: int) -> None:
        self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1


def start_demo(run_dir: Path, serve_port: int, key: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "RLPIPE_ROLLOUT_WORKER_SERVE_PORT": str(serve_port),
        "RLPIPE_ROLLOUT_WORKER_SERVE_API_KEY": key,
    }
    command = [sys.executable, "-m", "apps.cli", "demo", "--open-bus", "--duration-s", "3600",
               "--run-dir", str(run_dir)]  # fmt: skip
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


async def find_replica(
    run_dir: Path, serve_port: int, key: str, http: httpx.AsyncClient
) -> Replica:
    """The worker's health port (its log) and pid (pids.json), once its API serves."""
    log = run_dir / "logs" / "rollout-worker.log"
    port = None
    while port is None:
        await asyncio.sleep(1)
        lines = log.read_text().splitlines() if log.exists() else []
        port = next((_field(line, "port") for line in lines if "health server" in line), None)
    pids = json.loads((run_dir / "pids.json").read_text())
    replica = Replica(
        f"http://127.0.0.1:{serve_port}",
        f"http://127.0.0.1:{port}/healthz",
        key,
        int(pids["services"]["rollout-worker"][-1]),
        http,
    )
    while True:  # 503 until the worker has weights
        with contextlib.suppress(httpx.HTTPError):
            if (await replica.post(replica.body(n=1, max_tokens=1))).status_code == 200:
                return replica
        await asyncio.sleep(1)


def _field(line: str, name: str) -> Any:
    with contextlib.suppress(ValueError):
        return json.loads(line[line.index("{") :]).get(name)
    return None


class RawClient:
    """One keep-alive connection sending a prepared request, reading answers with few CPU
    cycles (httpx costs a flood of 429s more CPU than the server answering them)."""

    def __init__(self, port: int, request: bytes) -> None:
        self.port, self.request = port, request
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self) -> tuple[int, dict[str, str], bytes]:
        if self.streams is None:
            self.streams = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = self.streams
        try:
            writer.write(self.request)
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])}
            body = await reader.readexactly(int(headers.get("content-length") or 0))
        except (ConnectionError, asyncio.IncompleteReadError):
            writer.close()
            self.streams = None
            raise
        if headers.get("connection") == "close":
            writer.close()
            self.streams = None
        return int(head[0].split()[1]), headers, body

    def close(self) -> None:
        if self.streams is not None:
            self.streams[1].close()


def raw_request(replica: Replica, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {replica.key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode() + data


async def flood_client(client: RawClient, until: float, stats: FloodStats) -> None:
    try:
        while time.monotonic() < until:
            started = time.monotonic()
            try:
                status, headers, body = await client.post()
            except (ConnectionError, asyncio.IncompleteReadError):
                stats.count(0)
                continue
            stats.count(status)
            if status == 200:
                stats.answered_s.append(time.monotonic() - started)
                stats.completion_tokens += json.loads(body)["usage"]["completion_tokens"]
            else:
                await asyncio.sleep(float(headers.get("retry-after") or 1))
    finally:
        client.close()  # the clients go away: what they asked for is abandoned


async def stop_wave(replica: Replica, count: int) -> dict[str, int]:
    """`count` concurrent requests with 1,000 stop strings: their statuses."""
    body = replica.body(stop=[f"stop string {i:04d}" for i in range(1000)])
    responses = await asyncio.gather(*(replica.post(body) for _ in range(count)))
    statuses: dict[str, int] = {}
    for response in responses:
        statuses[str(response.status_code)] = statuses.get(str(response.status_code), 0) + 1
    return statuses


async def slow_client(port: int, until: float, held_s: list[float]) -> None:
    """Half a request head, held until the server closes the connection; again."""
    while time.monotonic() < until:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        opened = time.monotonic()
        with contextlib.suppress(ConnectionError):
            async with asyncio.timeout(max(0.1, until - opened)):
                while await reader.read(4096):
                    pass
                held_s.append(time.monotonic() - opened)
        writer.close()


async def nothing_running_after(replica: Replica, since: float) -> float:
    """Seconds from `since` until no served request runs, queues or is in the engine."""
    keys = ("serve_requests_in_engine", "serve_requests_running", "serve_requests_queued")
    while True:
        health = await replica.health()
        if not any(health.get(key) for key in keys):
            return time.monotonic() - since
        await asyncio.sleep(0.02)


async def wait_in_engine(replica: Replica, timeout_s: float = 60) -> bool:
    async with asyncio.timeout(timeout_s):
        while not (await replica.health()).get("serve_requests_in_engine"):
            await asyncio.sleep(0.02)
    return True


async def flood_window(replica: Replica, args: argparse.Namespace) -> dict[str, Any]:
    """The flood for `window_s`, then its clients disconnect; what each part saw."""
    until = time.monotonic() + args.window_s
    stats, held_s = FloodStats(), []
    port = int(replica.serve_url.rsplit(":", 1)[1])
    slow = [asyncio.create_task(slow_client(port, until, held_s)) for _ in range(args.slow)]
    wave = await stop_wave(replica, args.flood)
    stops = [f"never-{i:02d}-" + "z" * 100 for i in range(16)]  # the most allowed
    request = raw_request(replica, replica.body(stop=stops))
    flood = [
        asyncio.create_task(flood_client(RawClient(port, request), until, stats))
        for _ in range(args.flood)
    ]
    await asyncio.sleep(max(0.0, until - time.monotonic()))
    cut = time.monotonic()
    for task in flood + slow:
        task.cancel()
    await asyncio.gather(*flood, *slow, return_exceptions=True)
    stopped_s = await nothing_running_after(replica, cut)
    return {
        "stop_1000_wave_statuses": wave,
        "flood_statuses": stats.statuses,
        "flood_answered": len(stats.answered_s),
        "flood_answer_s_median": _median(stats.answered_s),
        "flood_completion_tokens": stats.completion_tokens,
        "slow_clients_cut": len(held_s),
        "slow_client_held_s": {"median": _median(held_s), "max": _max(held_s)},
        "flood_disconnected_nothing_running_after_s": round(stopped_s, 3),
    }


async def disconnect_probes(replica: Replica, count: int) -> dict[str, Any]:
    """Single long requests disconnected once in the engine: seconds until nothing runs."""
    stopped: list[float] = []
    finished_first = 0
    for _ in range(count):
        request = asyncio.create_task(replica.post(replica.body()))
        in_engine = asyncio.create_task(wait_in_engine(replica))
        await asyncio.wait({request, in_engine}, return_when=asyncio.FIRST_COMPLETED)
        if request.done():
            finished_first += 1
            in_engine.cancel()
            continue
        cut = time.monotonic()
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
        stopped.append(await nothing_running_after(replica, cut))
    return {
        "probes": count,
        "finished_before_disconnect": finished_first,
        "stopped_after_s": [round(s, 3) for s in stopped],
        "stopped_after_s_max": _max(stopped),
    }


async def sigterm_probe(replica: Replica, grace_s: float) -> dict[str, Any]:
    """SIGTERM to the worker under 4 long requests: time to exit, what the clients got."""
    requests = [asyncio.create_task(replica.post(replica.body())) for _ in range(4)]
    await wait_in_engine(replica)
    sent = time.monotonic()
    os.kill(replica.pid, signal.SIGTERM)
    while _alive(replica.pid):
        if time.monotonic() - sent > grace_s + 60:  # a hang: say so
            return {"exited_after_s": None, "drain_timeout_s": grace_s, "hung": True}
        await asyncio.sleep(0.02)
    exited_s = time.monotonic() - sent
    answers = await asyncio.gather(*requests, return_exceptions=True)
    statuses = [
        a.status_code if isinstance(a, httpx.Response) else type(a).__name__ for a in answers
    ]
    return {"exited_after_s": round(exited_s, 3), "drain_timeout_s": grace_s, "answers": statuses}


def _status(answer: httpx.Response | BaseException) -> int | str:
    """A response's status and error code, or the exception a client got instead."""
    if isinstance(answer, BaseException):
        return type(answer).__name__
    if answer.status_code == 200:
        return 200
    return f"{answer.status_code} {answer.json()['error']['code']}"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _max(values: list[float]) -> float | None:
    return round(max(values), 3) if values else None


def cpu_seconds(run_dir: Path) -> dict[str, float]:
    """CPU seconds (user + system) each service process, nats and this bench have used."""
    pids = json.loads((run_dir / "pids.json").read_text())
    named = {name: found[-1] for name, found in pids["services"].items() if found}
    named |= {"nats": pids["nats"][0], "bench": os.getpid()}
    ticks = os.sysconf("SC_CLK_TCK")
    used = {}
    for name, pid in named.items():
        with contextlib.suppress(FileNotFoundError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            used[name] = (int(fields[11]) + int(fields[12])) / ticks
    return used


def cpu_in_window(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: round(after[name] - before[name], 1) for name in before if name in after}


def steps_between(run_dir: Path, start: float, end: float) -> int:
    """Trainer steps that ended between Unix times `start` and `end`."""
    path = run_dir / "trainer" / "steps.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sum(1 for record in records if start <= record["time"] < end)


async def measure_window(
    replica: Replica, run_dir: Path, flooded: bool, args: argparse.Namespace
) -> dict[str, Any]:
    """One window, quiet or flooded: trainer steps, weight swaps, CPU by process."""
    swaps, cpu, start = (await replica.health())["weight_swaps"], cpu_seconds(run_dir), time.time()
    found = await flood_window(replica, args) if flooded else {}
    if not flooded:
        await asyncio.sleep(args.window_s)
    end = start + args.window_s  # a flood's window ends before its clients' disconnect
    steps = steps_between(run_dir, start, end)
    return {
        "flooded": flooded,
        "trainer_steps": steps,
        "steps_per_min": round(steps * 60 / args.window_s, 2),
        "weight_swaps": (await replica.health())["weight_swaps"] - swaps,
        "cpu_s": cpu_in_window(cpu, cpu_seconds(run_dir)),
        **found,
    }


async def run_bench(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The demo with serve mode on: warm, quiet and flooded windows in turn, the probes."""
    run_dir, serve_port, key = root / "demo", free_port(), secrets.token_urlsafe(16)
    demo = start_demo(run_dir, serve_port, key)
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=16)
    try:
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            replica = await find_replica(run_dir, serve_port, key, http)
            await asyncio.sleep(args.warm_s)
            windows = []
            for turn in range(args.rounds):  # quiet-flood, flood-quiet, ...: drift falls on both
                for flooded in (False, True) if turn % 2 == 0 else (True, False):
                    windows.append(await measure_window(replica, run_dir, flooded, args))
                    await asyncio.sleep(args.settle_s)
            probes = await disconnect_probes(replica, args.probes)
            sigterm = await sigterm_probe(replica, args.drain_timeout_s)
    finally:
        demo.send_signal(signal.SIGINT)
        demo.wait(timeout=300)
    sigterm |= stop_log_times(run_dir)
    return {"windows": windows, "disconnect_probes": probes, "sigterm": sigterm}


def stop_log_times(run_dir: Path) -> dict[str, Any]:
    """From the worker's log: seconds from its 'stop requested' to 'service stopped'."""
    lines = (run_dir / "logs" / "rollout-worker.log").read_text().splitlines()
    stamps = {}
    for line in lines:
        event = _field(line, "event")
        if event in ("stop requested; draining", "service stopped"):
            stamps.setdefault(event, _field(line, "timestamp"))
    if len(stamps) < 2:
        return {}
    began, ended = (
        datetime.fromisoformat(stamps[e]) for e in ("stop requested; draining", "service stopped")
    )
    return {"drained_in_s": round((ended - began).total_seconds(), 3)}


def summary(windows: list[dict[str, Any]], window_s: float) -> dict[str, Any]:
    """Steps a minute over the quiet and over the flooded windows, and their ratio."""
    rates = {}
    for name, flooded in (("quiet", False), ("flood", True)):
        steps = sum(w["trainer_steps"] for w in windows if w["flooded"] == flooded)
        count = sum(1 for w in windows if w["flooded"] == flooded)
        rates[name] = round(steps * 60 / (window_s * count), 2)
    ratio = round(rates["flood"] / rates["quiet"], 3) if rates["quiet"] else None
    return {"steps_per_min": rates, "flood_over_quiet": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=6, help="quiet + flooded window pairs")
    parser.add_argument("--warm-s", type=float, default=20.0)
    parser.add_argument("--settle-s", type=float, default=5.0, help="between two windows")
    parser.add_argument("--flood", type=int, default=64, help="concurrent n=16 clients")
    parser.add_argument("--slow", type=int, default=200, help="slow-header clients")
    parser.add_argument("--probes", type=int, default=5, help="single disconnect probes")
    parser.add_argument("--drain-timeout-s", type=float, default=10.0, help="the worker's")
    parser.add_argument("--engine-share", type=float, help="serve.engine_share (its default)")
    parser.add_argument("--hold-tokens", type=int, help="serve.hold_tokens (its default)")
    args = parser.parse_args()
    os.environ["RLPIPE_ROLLOUT_WORKER_DRAIN_TIMEOUT_S"] = str(args.drain_timeout_s)
    for name, value in (("ENGINE_SHARE", args.engine_share), ("HOLD_TOKENS", args.hold_tokens)):
        if value is not None:
            os.environ[f"RLPIPE_ROLLOUT_WORKER_SERVE_{name}"] = str(value)
    os.nice(10)  # the flood's clients stand for machines elsewhere: the demo's CPU comes first
    commit = git_commit()
    with tempfile.TemporaryDirectory(prefix="rlpipe-serve-flood-") as root:
        found = asyncio.run(run_bench(Path(root), args))
    document = {
        "benchmark": "serve_flood",
        "command": " ".join(["python", "bench/serve_flood_bench.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "git_commit": commit,
        "window_s": args.window_s,
        **summary(found["windows"], args.window_s),
        **found,
    }
    path = result_file("serve_flood")
    path.write_text(result_json(document))
    print(json.dumps(document, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
