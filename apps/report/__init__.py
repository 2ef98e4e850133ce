"""`rlpipe report RUN_DIR`: plots and a short human summary of a run, from its files.

    rlpipe report runs/20261126T120000Z              # plots in runs/.../report/, summary printed
    rlpipe report runs/20261126T120000Z --no-plots   # the summary only (no matplotlib needed)

It reads what the trainer wrote (`trainer/steps.jsonl`, `trainer/evals.jsonl`,
`trainer/eval_transcripts.jsonl`; see
libs.trainer.metrics), so it works on a finished run, a run still going, or a copied folder:
no bus, no services. `rlpipe demo` ends by printing the same summary and the plots' paths.

figures      the run's figures from its records, and the summary lines (no plotting library)
plots        the PNG plots (matplotlib, the `report` extra, imported only to draw)
transcripts  held-out episodes of the first and last evaluated versions (transcripts.md)
command      the `rlpipe report` subcommand
"""
