"""llama.cpp's convert_hf_to_gguf.py, run as its own `__main__` from its folder, with one addition: a tokenizer whose
pre-tokenizer llama.cpp does not recognise (it knows a tokenizer by the hash of a test string's ids, so a vocabulary
trained or extended here never matches) is written with the pre-tokenizer the user names. Without a name the
converter's own refusal stands.

    python .../hftrain/serving/gguf_runner.py CONVERTER_DIR PRE_TOKENIZER_OR_EMPTY -- converter arguments...

Run by its path, not `-m`: a working directory that holds another hftrain would be imported first.
"""

from __future__ import annotations

import os
import runpy
import sys


def with_named_pre_tokenizer(base_module, name: str) -> None:
    """The converter's get_vocab_base_pre answering `name` where it would refuse the tokenizer."""
    recognised = base_module.TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer):
        try:
            return recognised(self, tokenizer)
        except NotImplementedError:
            return name

    base_module.TextModel.get_vocab_base_pre = pre_tokenizer


def main(argv: list[str]) -> None:
    folder, pre_tokenizer, separator, *arguments = argv
    if separator != "--":
        raise SystemExit("usage: python gguf_runner.py CONVERTER_DIR PRE_TOKENIZER -- ARGS...")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [folder, os.path.join(folder, "gguf-py")] + [p for p in sys.path if os.path.abspath(p or ".") != here]
    if pre_tokenizer:
        from conversion import base  # llama.cpp's converter package, on the path just given

        with_named_pre_tokenizer(base, pre_tokenizer)
    script = os.path.join(folder, "convert_hf_to_gguf.py")
    sys.argv = [script, *arguments]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
