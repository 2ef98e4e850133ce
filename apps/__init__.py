"""The command layer: `rlpipe` (apps.cli) and what only a command runs, never a service.

The local launcher (`rlpipe demo`), the Ray deployment (`rlpipe ray`), the run report
(`rlpipe report`) and each subcommand's parser live here; they import libs/, proto/ and
start services/ as processes, and nothing in libs/ or services/ imports them.
"""
