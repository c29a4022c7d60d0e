"""Seeing a run: the live display, the JSON and HTML reports, `phoenixft status`, and exports."""
