"""Models and tokenizers, one module per concern: paths (a model folder checked before loading, remote code),
chat_template (data.chat_template), before_loading (every path a run loads, at once), tokenizer, model (the model:
dtype, attention, quantisation, liger, MoE upcycling, LoRA, packed rows), lora (peft's config), export (the shapes a
save writes, the merged model). The names other modules use are re-exported here."""

from ..errors import ModelError
from .export import loading_outside_zero3, save_merged, saved_shapes, without_tied_copies
from .model import join_packed_rows, load_model, reads_packing_from_one_row
from .lora import lora_config
from .paths import local_config, remote_code, resolved_name_or_path, warn_remote_code
from .before_loading import path_problems
from .chat_template import chat_template_file, chat_template_text
from .tokenizer import load_tokenizer

__all__ = ["ModelError", "chat_template_file", "chat_template_text", "join_packed_rows", "load_model", "load_tokenizer",
           "loading_outside_zero3", "local_config", "lora_config", "path_problems", "reads_packing_from_one_row",
           "remote_code", "resolved_name_or_path", "save_merged", "saved_shapes", "warn_remote_code",
           "without_tied_copies"]
