"""Build DeepSpeed's CPU ops into hftrain's extension cache, or bring them up to date, with a progress line per op.

    .venv/bin/python scripts/build_deepspeed_ops.py

scripts/setup.sh runs it (told HFTRAIN_SETUP_DEFER_OPS=1, scripts/test.sh does, beside the tests: tests/op_build.py),
so that no run and no test pays for a JIT build (minutes on 2 cores) inside its own time-out. Each op is loaded as a
run loads it: torch runs ninja, which compiles again only what is older than its sources (an op whose `.so` exists
is still rebuilt after its environment was installed again: a fresh venv at the same path, as each CI run makes), and
an op that is up to date loads in seconds. Build locks a stopped build left are released (hftrain.launch.op_cache).
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hftrain.launch.machine import extensions_dir  # noqa: E402
from hftrain.launch.op_cache import settle_build_locks  # noqa: E402

# The CPU ops hftrain's DeepSpeed strategies JIT-build on first use.
DEEPSPEED_CPU_OPS = ("ShareMemCommBuilder", "PinMemoryBuilder", "CPUAdamBuilder", "AsyncIOBuilder")


def deepspeed_op_builders() -> list:
    """DeepSpeed's builders of DEEPSPEED_CPU_OPS that can build here (async_io needs libaio)."""
    from deepspeed.accelerator import get_accelerator

    builders = [get_accelerator().create_op_builder(name) for name in DEEPSPEED_CPU_OPS]
    return [b for b in builders if b.name != "async_io" or b.is_compatible(verbose=False)]


def op_is_built(builder, root: str | None = None) -> bool:
    """torch's JIT cache holds `<root>/<name>/<name>.so` once the op has been built."""
    root = root or extensions_dir()
    return os.path.isfile(os.path.join(root, builder.name, f"{builder.name}.so"))


def missing_ops(root: str | None = None) -> list[str]:
    """The names of the ops not built yet in `root` (the cache by default)."""
    return [b.name for b in deepspeed_op_builders() if not op_is_built(b, root)]


# Debian's ccache package: c++, g++, cc and gcc here are ccache, which runs the compiler on a miss.
CCACHE_MASQUERADE = "/usr/lib/ccache"


def compile_through_ccache(environ=os.environ, masquerade: str = CCACHE_MASQUERADE) -> bool:
    """Where ccache is installed (scripts/setup.sh installs it), this process's `c++` is ccache's: an op ninja rebuilds
    only because pip dated its sources anew (each fresh venv, as each CI run makes one at the same path) compiles
    from ccache's cache (~/.cache/ccache) in seconds instead of minutes. The commands stay `c++ ...`, as torch writes
    them into each op's build.ninja (CXX would change them, and a run without it would rebuild the op); a run that
    later rebuilds an op without ccache compiles the same commands. Whether it did."""
    if not os.access(os.path.join(masquerade, "c++"), os.X_OK):
        return False
    path = environ.get("PATH", "")
    if masquerade not in path.split(os.pathsep):
        environ["PATH"] = masquerade + (os.pathsep + path if path else "")
    return True


def stop_cleanly_on_sigterm() -> None:
    """scripts/test.sh ends a background build with SIGTERM: raised as SystemExit, torch's JIT build releases its
    `<op>/lock` (a `finally`) and subprocess.run kills ninja, so the next build does not wait on a lock left behind."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main(argv: list[str]) -> int:
    root = os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
    if argv:
        print(f"usage: {sys.argv[0]}", file=sys.stderr)
        return 2
    settle_build_locks(root, say=lambda message: print(f"setup: {message}", flush=True))
    stop_cleanly_on_sigterm()
    if compile_through_ccache():
        print(f"setup: compiling through ccache ({CCACHE_MASQUERADE})", flush=True)
    builders = deepspeed_op_builders()
    for i, builder in enumerate(builders, 1):
        cached = op_is_built(builder, root)
        verb = "loading (rebuilt if its sources changed)" if cached else "building (a few minutes on 2 cores)"
        print(f"setup: DeepSpeed op {builder.name} ({i}/{len(builders)}): {verb} ...", end=" ", flush=True)
        t0 = time.time()
        builder.load(verbose=False)
        print(f"done in {time.time() - t0:.0f} s", flush=True)
    print(f"setup: DeepSpeed ops ready in {root}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
