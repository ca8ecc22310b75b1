"""The `kpr` command: `kpr run` (the agent), `kpr status`, `kpr cleanup`, `kpr bench`..."""
