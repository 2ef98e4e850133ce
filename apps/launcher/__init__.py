"""The local launcher behind `make demo`: NATS, the bus and every service, supervised.

Entry points: `run_local(LaunchOptions(...))`, or `add_demo_arguments` + `options_from_args`
for a command line; `Supervisor` runs and restarts child processes on its own.
"""

from apps.launcher.run import LaunchOptions, add_demo_arguments, options_from_args, run_local
from apps.launcher.supervisor import Backoff, ChildSpec, Supervisor

__all__ = [
    "Backoff",
    "ChildSpec",
    "LaunchOptions",
    "Supervisor",
    "add_demo_arguments",
    "options_from_args",
    "run_local",
]
