"""``python -m phoenixft.sim``: the ``phoenixft simulate`` command without the rest of the CLI."""

from __future__ import annotations

import sys

from .cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
