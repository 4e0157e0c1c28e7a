"""Tiny models for demos and tests: a tokenizer trained locally and a causal LM with random weights.

Nothing here touches the Hub: the tokenizer is trained on the texts it is given (tokenizers' BPE trainer),
the model is built from a config.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast

from .config import DataSource
from .data import canonicalise, detect_format, read_rows
from .heads import Head
from .modeling import chat_template_text
from .vision import tiny_models as tiny_vision

# ChatML: <|im_start|>role\ncontent<|im_end|>\n ; generation stops at <|im_end|> (the eos token). Tools, when a row
# has them, are listed in a system turn first, and an assistant's tool calls follow its content as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2.5's layout), so that tool-calling rows are
# trained with their calls.
CHATML_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- for call in message['tool_calls'] or [] %}{{ '<tool_call>' + call['function'] | tojson + '</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TINY_LLAMA = {  # ~0.9M parameters: small enough to learn the demo task on a CPU
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512, chat_template: str | None = None):
    """A byte-level BPE tokenizer trained on `texts`, with ChatML special tokens, and ChatML's template or
    `chat_template` (its text)."""
    tok = Tokenizer(models.BPE())
    # Numbers split into single digits, as Qwen2's and DeepSeek's tokenizers do: a number then reads the same in a
    # prompt, a tool call's JSON and a tool's answer, so a tiny model can learn to copy it (the tool-use demo).
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        unk_token=None,
        chat_template=chat_template or CHATML_TEMPLATE,
    )


def _walk(value, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for x in value.values():
            _walk(x, out)
    elif isinstance(value, list):
        for x in value:
            _walk(x, out)


def strings_of_rows(paths: Iterable[str]) -> list[str]:
    """Every string of the rows of data files, whatever their layout (image rows' texts among them)."""
    out: list[str] = []
    for p in paths:
        _walk([row for _, row in read_rows(DataSource(path=p), f"--data {p}").iterate()], out)
    return out


def texts_of_data(paths: Iterable[str], chat_template: str | None = None) -> list[str]:
    """Every string of the canonical examples of data files (any layout and file type the data loader reads: the
    same reader, the same row errors), for tokenizer training: contents, tool names and arguments, tools. Rows of
    no layout (a JSONL of questions and answers, say) give all their strings. With `chat_template` (its text) each
    conversation rendered by it too, so that the template's own text (a tool-calling system prompt of hundreds of
    characters, say) becomes a few tokens, as in a real model's vocabulary."""
    out: list[str] = []
    for p in paths:
        src, key = DataSource(path=p), f"--data {p}"
        rows = read_rows(src, key)
        if detect_format(rows.columns) is None:  # rows of no training layout: their strings are text all the same
            _walk([row for _, row in rows.iterate()], out)
        else:
            examples = [canon for _, canon in canonicalise(rows, src, key, has_template=True)[1]]
            _walk(examples, out)
            if chat_template:
                out.extend(_rendered(examples, chat_template))
    return out


def _rendered(examples: list[dict], chat_template: str) -> list[str]:
    from transformers.utils.chat_template_utils import render_jinja_template

    return [render_jinja_template([ex["messages"]], tools=ex.get("tools"), chat_template=chat_template)[0][0]
            for ex in examples if "messages" in ex]


texts_of_jsonl = texts_of_data  # the name tests, benches and other branches call


def build_tiny_model(
    output: str, texts: list[str], config: dict | None = None, vocab_size: int = 512, seed: int = 0,
    chat_template: str | None = None,
) -> str:
    """Train a tokenizer on `texts`, build a Llama-style model with random weights, save both to `output`."""
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size, chat_template=chat_template)
    cfg = dict(TINY_LLAMA, **(config or {}))
    model_config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **cfg,
    )
    torch.manual_seed(seed)
    model = Head.CAUSAL_LM.auto_class.from_config(model_config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    os.makedirs(output, exist_ok=True)
    model.save_pretrained(output, safe_serialization=True)
    tokenizer.save_pretrained(output)
    return output


def build_tiny_vision_model(output: str, texts: list[str], family: str = "qwen2_5_vl", vocab_size: int = 512,
                            seed: int = 0) -> str:
    """A tiny image-text-to-text model of `family` (hftrain.vision.tiny.BUILDERS: qwen2_5_vl, llava) with a tokenizer
    trained on `texts` and the family's chat template, and its processor (PIL image processor), saved to `output`."""
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size, chat_template=tiny_vision.template(family))
    return tiny_vision.save_tiny_vision_model(output, tokenizer, family, seed=seed)


def add_tiny_model_command(sub) -> None:
    """`hftrain tiny-model` (registered in cli.COMMANDS)."""
    t = sub.add_parser("tiny-model", allow_abbrev=False, help="Build a tiny Llama-style model (random weights) with a "
                       "tokenizer trained on data files. No Hub needed.")
    t.add_argument("--data", nargs="+", required=True,
                   help="data files (any layout and file type data.sources reads) whose texts train the tokenizer")
    t.add_argument("--output", required=True, help="folder to write the model and tokenizer to")
    t.add_argument("--config", default=None, help='JSON of LlamaConfig overrides, e.g. \'{"num_hidden_layers": 4}\'')
    t.add_argument("--chat-template", default=None,
                   help="the tokenizer's chat template (a .jinja file, or trl:NAME for one TRL ships; default ChatML); "
                        "the data's conversations rendered with it train the tokenizer too")
    t.add_argument("--vision", default=None, choices=sorted(tiny_vision.BUILDERS),
                   help="build a tiny image-text-to-text model of this family instead (vision tower, projector, "
                        "language model; its chat template and processor saved beside it)")
    t.add_argument("--vocab-size", type=int, default=512)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(fn=_tiny_model)


def _tiny_model(ns) -> int:
    if ns.vision:
        if ns.config or ns.chat_template:
            raise SystemExit("hftrain tiny-model: --vision builds the family's own config and chat template; "
                             "drop --config and --chat-template")
        out = build_tiny_vision_model(ns.output, strings_of_rows(ns.data), ns.vision, vocab_size=ns.vocab_size,
                                      seed=ns.seed)
        print(f"hftrain: tiny {ns.vision} image-text-to-text model and processor written to {out}")
        return 0
    config = json.loads(ns.config) if ns.config else None
    template = chat_template_text(ns.chat_template, "--chat-template") if ns.chat_template else None
    out = build_tiny_model(ns.output, texts_of_data(ns.data, template), config=config, vocab_size=ns.vocab_size,
                           seed=ns.seed, chat_template=template)
    print(f"hftrain: tiny model with a locally trained tokenizer written to {out}")
    return 0
