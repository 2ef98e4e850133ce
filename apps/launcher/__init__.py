"""The local launcher behind `make demo`: NATS, the bus and every service, supervised.

Entry points live in their modules (this package re-exports nothing, so importing one part
does not load the rest): `apps.launcher.run` (`run_local(LaunchOptions(...))`, or
`add_demo_arguments` + `options_from_args` for a command line) and
`apps.launcher.supervisor` (`Supervisor` runs and restarts child processes on its own).
"""
