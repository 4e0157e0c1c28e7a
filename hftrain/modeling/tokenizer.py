"""The tokenizer (transformers AutoTokenizer): fast only, with the recipe's chat template and a pad token."""

from __future__ import annotations

import sys

from transformers import AutoTokenizer

from ..config import ModelSection
from ..distributed import print0
from ..errors import ModelError
from .paths import path_problem, raise_if, warn_remote_code
from .chat_template import chat_template_problem, chat_template_text


def load_tokenizer(cfg: ModelSection, chat_template: str | None = None, say_padding: str | None = None):
    """The tokenizer of `cfg` (fast only), with `chat_template` and a pad token (padded_with); `say_padding`: the
    recipe key of the model whose classifier reads the pad token, to say on stderr which token pads where the
    tokenizer has none of its own."""
    name = cfg.tokenizer_name_or_path or cfg.name_or_path
    raise_if(path_problem(name, "model.tokenizer_name_or_path" if cfg.tokenizer_name_or_path
                            else "model.name_or_path"))
    raise_if(chat_template_problem(chat_template))
    warn_remote_code(cfg, name)
    key = "model.tokenizer_name_or_path" if cfg.tokenizer_name_or_path else "model.name_or_path"
    try:
        tok = AutoTokenizer.from_pretrained(name, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError) as e:  # a folder with broken or missing tokenizer files
        raise ModelError(f"{key}: cannot load a tokenizer from {name} ({type(e).__name__}: {str(e)[:300]}); "
                         "check its tokenizer files (tokenizer.json, tokenizer_config.json) or save it again") from None
    if not getattr(tok, "is_fast", False):
        raise ModelError(f"model.tokenizer_name_or_path: {name} has no fast tokenizer; hftrain's loss masks "
                         "need offsets")
    if chat_template:
        tok.chat_template = chat_template_text(chat_template)
    taken = padded_with(tok)
    if taken and say_padding:
        print0(f"hftrain: {say_padding}.name_or_path: the tokenizer has no pad token; it pads with its "
               f"{taken.partition('_')[0]} token {tok.pad_token!r} (id {tok.pad_token_id}), and the classifier reads "
               "its score at the last token before padding (config.pad_token_id)", file=sys.stderr)
    return tok


def padded_with(tok) -> str | None:
    """A tokenizer with no pad token pads with its EOS token, else its UNK token: labels are padded with -100 and
    the attention mask hides padding, so that is safe (a sequence classifier reads its score at the last token
    before padding: model.score_pad_token). Returns which it took ('eos_token', 'unk_token'), None where it has its
    own pad token or none to take."""
    if tok.pad_token is not None:
        return None
    for name in ("eos_token", "unk_token"):
        if getattr(tok, name, None) is not None:
            tok.pad_token = getattr(tok, name)
            return name
    return None
