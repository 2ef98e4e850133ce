"""One rlpipe service as a Ray actor: the actor owns the service's process on its node.

    actor = ray.remote(ServiceProcess).options(num_cpus=1, max_restarts=-1).remote(
        "rlpipe-reward", plan.service("reward"), plan.run_dir)
    ray.get(actor.status.remote())            # pid, node, /healthz answer
    ray.get(actor.stop.remote(30.0))          # SIGTERM: the service drains, then exits

The service runs as `python -m services.<name>` (the trainer of N ranks: torchrun, which
starts them on this node) with its plan's variables and a free health
port on that node. When it exits non-zero (a crash) the actor exits with it, so Ray restarts
the actor (its `max_restarts`) and a new process starts; when the actor's process dies, the
kernel kills the service too (PR_SET_PDEATHSIG), so none is left behind. An exit 0 (the
trainer's step budget done) is the work finished: the actor stays, reporting it. `stop` is
the graceful way out: SIGTERM, which the services drain on (a rollout-worker stops pulling,
finishes its episodes for its drain time and hands back the rest).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from apps.ray_deploy.plan import ServicePlan
from libs.nats_server import free_port
from libs.process_lifetime import die_with_parent


class ServiceProcess:
    """The body of a service actor (wrapped with `ray.remote` by the controller)."""

    def __init__(self, actor_name: str, plan: ServicePlan, run_dir: str) -> None:
        self.actor_name, self.plan = actor_name, plan
        self.port = free_port()
        self.started_at = time.time()
        self.stopping = False
        logs = Path(run_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"{actor_name}.log"
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {actor_name}: start at {time.ctime()}\n".encode())
            self.process = subprocess.Popen(
                plan.command,
                env=self._environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=functools.partial(die_with_parent, signal.SIGKILL, os.getpid()),
            )
        threading.Thread(target=self._exit_with_service, daemon=True).start()

    def _environment(self) -> dict[str, str]:
        """The plan's variables, then the health port this actor reads (several workers share
        a node, so it is always a free one); the feedback API's port is free unless given."""
        prefix = self.plan.env_prefix
        env = {**os.environ, **self.plan.env}
        if self.plan.name == "feedback-ingester":
            env.setdefault("RLPIPE_FEEDBACK_INGESTER_API_PORT", str(free_port()))
        return env | {f"{prefix}HTTP_HOST": "127.0.0.1", f"{prefix}HTTP_PORT": str(self.port)}

    def _exit_with_service(self) -> None:
        """A crashed service takes the actor down, for Ray to restart both."""
        code = self.process.wait()
        if code != 0 and not self.stopping:
            os._exit(1)

    def status(self) -> dict[str, Any]:
        """Where it runs and how it is: pid, node, exit code, the service's /healthz."""
        code = self.process.poll()
        return {
            "actor": self.actor_name,
            "service": self.plan.name,
            "pid": self.process.pid,
            "node": socket.gethostname(),
            "node_ip": _node_ip(),
            "started_at": self.started_at,
            "state": "running" if code is None else ("finished" if code == 0 else "exited"),
            "exit_code": code,
            "health": self._health() if code is None else None,
            "log": str(self.log_path),
        }

    def _health(self) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                body: dict[str, Any] = json.loads(response.read())
                return body
        except urllib.error.HTTPError as exc:  # 503 with the reason
            try:
                answer: dict[str, Any] = json.loads(exc.read())
                return answer
            except ValueError:
                return {"status": f"http {exc.code}"}
        except (OSError, ValueError):
            return {"status": "unreachable"}

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM and wait up to `grace_s` for the drain; SIGKILL after. The exit code."""
        self.stopping = True
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def _node_ip() -> str:
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # outside Ray (tests of the class itself)
        return "127.0.0.1"
