"""`python -m kpr.cli`: the `kpr` command, for callers that run it under a given Python."""

from kpr.cli.main import app

app(prog_name="kpr")
