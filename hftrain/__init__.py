"""hftrain: fine-tune LLMs on the Hugging Face stack from one YAML recipe."""

import os

__version__ = "0.1.0"

# The parent (launcher) of this process as seen at the first import of hftrain, before torch and the rest load:
# lifetime.die_with_parent compares it with the parent later, to notice a launcher that died in between.
PARENT_PID_AT_START = os.getppid()
