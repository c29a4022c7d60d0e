import sys

from phoenixft.cli.main import main

sys.exit(main())
