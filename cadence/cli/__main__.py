"""`python -m cadence.cli`: the `cadence` command."""

import sys

from cadence.cli import main

if __name__ == "__main__":  # importing this module (the docs' doctest run) runs nothing
    sys.exit(main())
