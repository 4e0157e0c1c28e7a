"""`python -m hftrain.cli`: the `hftrain` command (the console script calls hftrain.cli:main)."""

import sys

from . import main

sys.exit(main())
