"""The `phoenixft` command line: one module per subcommand (`cmd_*.py`)."""
