"""GGUF files of a model folder through llama.cpp's own converter (convert_hf_to_gguf.py, from a llama.cpp checkout
or scripts/fetch_llama_cpp_converter.sh): the architectures it supports asked of it, each type written by it in a
process of its own (gguf_runner.py), its refusals said in one line."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

from ..errors import ModelError
from . import gguf_runner

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")  # the converter's full-precision types and its 8-bit quantisation
CONVERTER_SETTING = "HFTRAIN_LLAMA_CPP"
SCRIPT = "convert_hf_to_gguf.py"
UNKNOWN_PRE_TOKENIZER = "BPE pre-tokenizer was not recognized"
CONVERT_TIMEOUT_S = 3600
TEXT_MODELS = "TEXT models:"  # the converter's list of language models (the other: vision and audio projectors)


def converter_dir(given: str | None) -> str:
    """The folder holding llama.cpp's convert_hf_to_gguf.py: --converter, else $HFTRAIN_LLAMA_CPP."""
    folder = given or os.environ.get(CONVERTER_SETTING)
    if not folder:
        raise ModelError(f"--gguf needs llama.cpp's converter: give --converter DIR (a llama.cpp checkout, or the "
                         f"folder scripts/fetch_llama_cpp_converter.sh writes) or set {CONVERTER_SETTING}")
    if not os.path.isfile(os.path.join(folder, SCRIPT)):
        raise ModelError(f"{folder}: no {SCRIPT} there (give a llama.cpp checkout, or the folder "
                         "scripts/fetch_llama_cpp_converter.sh writes)")
    return folder


def _runner(folder: str, pre_tokenizer: str | None, arguments: list[str]) -> list[str]:
    return [sys.executable, gguf_runner.__file__, folder, pre_tokenizer or "", "--", *arguments]


@functools.cache
def supported_architectures(folder: str) -> tuple[str, ...]:
    """The text models' architectures (config.json's `architectures`) the converter writes, as it lists them (on its
    log, standard error)."""
    out = subprocess.run(_runner(folder, None, ["--print-supported-models"]), capture_output=True, text=True,
                         timeout=300)
    listed, section = [], None
    for line in (out.stdout + out.stderr).splitlines():
        if line.strip().endswith("models:"):
            section = line.strip()
        elif section == TEXT_MODELS and line.strip().startswith("- "):
            listed.append(line.strip()[2:])
    return tuple(listed)


def architecture_problem(model: str, folder: str) -> str | None:
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        architectures = json.load(f).get("architectures") or []
    supported = supported_architectures(folder)
    if any(a in supported for a in architectures):
        return None
    return (f"{model}: llama.cpp's converter does not write {', '.join(architectures) or 'this model'} (it writes "
            f"{len(supported)} architectures: {', '.join(supported)})")


def convert(model: str, folder: str, gguf_type: str, outfile: str, pre_tokenizer: str | None = None) -> str:
    """`model` (a folder of safetensors) written as `outfile` in `gguf_type`; a refusal of the converter raised as a
    ModelError."""
    problem = architecture_problem(model, folder)
    if problem:
        raise ModelError(problem)
    arguments = [model, "--outfile", outfile, "--outtype", gguf_type]
    out = subprocess.run(_runner(folder, pre_tokenizer, arguments), capture_output=True, text=True,
                         timeout=CONVERT_TIMEOUT_S)
    if out.returncode == 0:
        return outfile
    if UNKNOWN_PRE_TOKENIZER in out.stderr:
        raise ModelError(f"{model}: llama.cpp's converter does not recognise this tokenizer's pre-tokenizer (it knows "
                         "a tokenizer by a hash of its ids for a test string, which no vocabulary trained or extended "
                         "here matches): give --pre-tokenizer NAME, the llama.cpp pre-tokenizer whose splitting rules "
                         "the tokenizer's pre_tokenizer follows (gpt-2, llama-bpe, qwen2, ...)")
    raise ModelError(f"{model}: llama.cpp's converter failed ({gguf_type}):\n{out.stderr[-3000:]}")
