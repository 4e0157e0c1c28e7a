"""The tokenizer (transformers AutoTokenizer): fast only, with the recipe's chat template and a pad token."""

from __future__ import annotations

from transformers import AutoTokenizer

from ..config import ModelSection
from ..errors import ModelError
from .paths import path_problem, raise_if, warn_remote_code
from .chat_template import chat_template_problem, chat_template_text


def load_tokenizer(cfg: ModelSection, chat_template: str | None = None):
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
    if tok.pad_token is None:
        # Labels are padded with -100 and the attention mask hides padding, so reusing EOS for padding is safe.
        tok.pad_token = tok.eos_token
    return tok
