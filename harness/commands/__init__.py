"""One module per subcommand of `harness` (see harness/cli.py)."""
