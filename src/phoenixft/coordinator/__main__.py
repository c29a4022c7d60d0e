"""`python -m phoenixft.coordinator`: the coordinator process (see the package's docstring)."""

import sys

from phoenixft.coordinator import main

__all__: list[str] = []

sys.exit(main())
