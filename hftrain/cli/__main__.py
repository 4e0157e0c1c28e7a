"""`python -m hftrain.cli`: the `hftrain` command (the console script calls hftrain.cli:main)."""

import sys

from . import main

if __name__ == "__main__":  # imported (a test walking every module), it runs nothing
    sys.exit(main())
