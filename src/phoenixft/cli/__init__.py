"""The `phoenixft` command line: one module per subcommand (`cmd_*.py`)."""

from phoenixft.cli import argv_scrub  # noqa: E402, F401  (first: a --token on the command line is scrubbed at once)
