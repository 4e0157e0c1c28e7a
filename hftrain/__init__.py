"""hftrain: fine-tune LLMs on the Hugging Face stack from one YAML recipe."""

import ctypes
import ctypes.util
import logging
import os
import sys

__version__ = "0.1.0"

# bitsandbytes (which peft imports, and transformers' Trainer imports peft) logs a warning at import on a CPU with
# AVX512-BF16: it could not fetch its bf16 inference kernel from the Hub (`pip install kernels`). hftrain keeps the
# 4-bit layers' training kernel there (quantization.keep_training_kernels), so the line, in every process of every
# run, asks for something that would not be used.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

# The parent (launcher) of this process as seen at the first import of hftrain, before torch and the rest load:
# lifetime.die_with_parent compares it with the parent later, to notice a launcher that died in between.
PARENT_PID_AT_START = os.getppid()

# A torch elastic worker (TORCHELASTIC_RUN_ID: torchrun, accelerate launch) asks the kernel for SIGKILL when its
# launcher ends as soon as hftrain is first imported, before torch and the rest load: a launcher killed during the
# workers' start-up (seconds of imports, many more on a loaded machine) then ends them at once, not once they reach
# lifetime.die_with_parent, which arms the same signal (lifetime.py imports torch, hence libc's prctl here).
#
# The signal only covers a launcher that ends after it is armed. One killed in the moment between starting a worker
# and the worker's first import of hftrain (seen in the suite under load) has already left it re-parented to init,
# and PARENT_PID_AT_START is then init: nothing would ever end the worker. torch elastic's agent is a Python process,
# so a worker whose parent is pid 1 and not a Python interpreter (torchrun as a container's first process is one)
# has lost its launcher and ends here, before it writes anything. (A subreaper between it and init is not noticed.)


def _orphaned_at_start() -> bool:
    if os.getppid() != 1:
        return False
    try:
        exe = os.path.basename(os.readlink("/proc/1/exe"))
    except PermissionError:  # init of another user (root), not a launcher of ours
        return True
    except OSError:  # no /proc to read: nothing is known
        return False
    return not exe.startswith(("python", "pypy"))


if os.environ.get("TORCHELASTIC_RUN_ID") and sys.platform.startswith("linux"):
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):  # no libc ctypes can open: die_with_parent's watch thread still ends it
        pass
    if _orphaned_at_start():
        sys.stderr.write("hftrain: this worker's launcher ended before it started (it now belongs to init): "
                         "ending it\n")
        os._exit(137)
