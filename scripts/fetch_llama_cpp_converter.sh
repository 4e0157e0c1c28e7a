#!/usr/bin/env bash
# llama.cpp's HF -> GGUF converter (convert_hf_to_gguf.py, its conversion/ package and its own gguf-py), which
# `hftrain export --gguf` runs. llama.cpp publishes no wheel of it; the llama-cpp-python sdist on PyPI carries
# llama.cpp's tree, so it is taken from there, pinned (LLAMA_CPP_PYTHON), and only the converter's files are kept.
# Usage: bash scripts/fetch_llama_cpp_converter.sh [DEST]   (default: .venv/llama.cpp-converter; then
# `hftrain export --converter DEST`, or HFTRAIN_LLAMA_CPP=DEST). A llama.cpp checkout works as well.
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_CPP_PYTHON=0.3.36
dest="${1:-.venv/llama.cpp-converter}"
if [ -f "$dest/convert_hf_to_gguf.py" ] && [ "$(cat "$dest/.version" 2>/dev/null)" = "$LLAMA_CPP_PYTHON" ]; then
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python=.venv/bin/python
[ -x "$python" ] || python=python3
"$python" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$work"
root="llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp"
tar xzf "$work"/llama_cpp_python-*.tar.gz -C "$work" "$root/convert_hf_to_gguf.py" "$root/conversion" \
  "$root/gguf-py" "$root/LICENSE"
rm -rf "$dest.tmp" && mkdir -p "$(dirname "$dest")"
mv "$work/$root" "$dest.tmp"
echo "$LLAMA_CPP_PYTHON" > "$dest.tmp/.version"
rm -rf "$dest" && mv "$dest.tmp" "$dest"
echo "llama.cpp's converter (from llama-cpp-python $LLAMA_CPP_PYTHON) in $dest"
