"""hftrain: fine-tune LLMs on the Hugging Face stack from one YAML recipe."""

import ctypes
import ctypes.util
import os
import sys

__version__ = "0.1.0"

# The parent (launcher) of this process as seen at the first import of hftrain, before torch and the rest load:
# lifetime.die_with_parent compares it with the parent later, to notice a launcher that died in between.
PARENT_PID_AT_START = os.getppid()

# A torch elastic worker (TORCHELASTIC_RUN_ID: torchrun, accelerate launch) asks the kernel for SIGKILL when its
# launcher ends as soon as hftrain is first imported, before torch and the rest load: a launcher killed during the
# workers' start-up (seconds of imports, many more on a loaded machine) then ends them at once, not once they reach
# lifetime.die_with_parent, which arms the same signal (lifetime.py imports torch, hence libc's prctl here).
if os.environ.get("TORCHELASTIC_RUN_ID") and sys.platform.startswith("linux"):
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):  # no libc ctypes can open: die_with_parent's watch thread still ends it
        pass
