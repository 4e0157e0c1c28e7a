"""Real chat templates of model families, each with an oracle (the same template with {% generation %} markers), and
tokenizers to render them: a byte-level BPE trained here (no Hub), with each family's control tokens added as single
ids, its bos/eos, and the stop tokens of its model's generation_config.json (stop_ids reads that file beside the
tokenizer, as it would for a model from the Hub; one family has none, as a tokenizer saved alone).

The templates are TRL's (every *_training.jinja TRL ships, with the original it patches) and tests/data/templates
(each file's first line names its model; the oracles of the families TRL has none for are in
tests/data/templates/oracles, see the README there)."""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass, field

import trl
from tokenizers import processors

from hftrain.tiny import train_tokenizer

TRL_TEMPLATES = os.path.join(os.path.dirname(trl.__file__), "chat_templates")
LOCAL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "templates")
ORACLES = os.path.join(LOCAL, "oracles")
DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
CHATML_STOP = ("<|im_end|>", "<|endoftext|>")  # Qwen's generation_config.json: 151645, 151643
LLAMA31_STOP = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")  # 128001, 128008, 128009


@dataclass(frozen=True)
class Family:
    name: str
    template: str  # path of the model's own chat template
    oracle: str  # path of the same template with {% generation %} markers (TRL's training variant)
    bos: str | None
    eos: str
    stop: tuple[str, ...] = ()  # generation_config.json eos_token_id, as tokens (the eos alone when empty)
    kwargs: dict = field(default_factory=dict)
    generation_config: bool = True  # whether a generation_config.json lies beside the tokenizer


def _trl(name: str, bos, eos, stop=(), **kwargs) -> Family:
    return Family(name, os.path.join(TRL_TEMPLATES, f"{name}.jinja"),
                  os.path.join(TRL_TEMPLATES, f"{name}_training.jinja"), bos, eos, tuple(stop), kwargs)


def _local(name: str, oracle: str, bos, eos, stop=()) -> Family:
    return Family(name, os.path.join(LOCAL, f"{name}.jinja"), oracle, bos, eos, tuple(stop))


FAMILIES = {f.name: f for f in [
    _trl("cohere", "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    _trl("cohere2", "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    _trl("deepseek_r1_distill", *DEEPSEEK),
    _trl("deepseekv3", *DEEPSEEK),
    _trl("diffusion_gemma", "<bos>", "<eos>", ("<eos>", "<turn|>", "<|tool_response>")),  # Gemma 4: [1, 106, 50]
    _trl("gemma", "<bos>", "<eos>", ("<eos>", "<end_of_turn>")),
    _trl("gemma3", "<bos>", "<eos>", ("<eos>", "<end_of_turn>")),
    _trl("glm4moe", None, "<|endoftext|>", ("<|endoftext|>", "<|user|>", "<|observation|>")),
    _trl("gptoss", "<|startoftext|>", "<|return|>", ("<|return|>", "<|endoftext|>", "<|call|>")),
    _trl("idefics3", "<|begin_of_text|>", "<end_of_utterance>"),
    _trl("lfm2", "<|startoftext|>", "<|im_end|>"),
    _trl("lfm2_v2", "<|startoftext|>", "<|im_end|>"),
    _trl("llama3", "<|begin_of_text|>", "<|eot_id|>", ("<|end_of_text|>", "<|eot_id|>")),
    _trl("llava_next", "<s>", "</s>"),
    _trl("muse_glimmer", "<|begin_of_text|>", "<|eot|>", ("<|eot|>", "<|eom|>")),
    _trl("nemotron_3_nano", "<s>", "<|im_end|>"),
    _trl("nemotron_3_super", "<s>", "<|im_end|>"),
    _trl("nemotron_3_ultra", "<s>", "<|im_end|>"),
    _trl("nemotron_3_5_lightning", "<s>", "<|im_end|>"),
    _trl("phi3", "<s>", "<|endoftext|>", ("<|end|>", "<|assistant|>", "<|endoftext|>")),
    _trl("phi3_5", "<s>", "<|endoftext|>", ("<|end|>", "<|assistant|>", "<|endoftext|>")),
    _trl("qwen2_5", None, "<|im_end|>", CHATML_STOP),
    _trl("qwen2_5_vl", None, "<|im_end|>", CHATML_STOP),
    _trl("qwen3", None, "<|im_end|>", CHATML_STOP),
    _trl("qwen3_instruct_2507", None, "<|im_end|>", CHATML_STOP),
    _trl("qwen3_vl", None, "<|im_end|>", CHATML_STOP),
    _trl("qwen3_5_think", None, "<|im_end|>", CHATML_STOP),
    _trl("qwen3_5_nothink", None, "<|im_end|>", CHATML_STOP),
    _trl("qwen3_6", None, "<|im_end|>", CHATML_STOP),
    _trl("qwen3_8", None, "<|im_end|>", CHATML_STOP),
    _trl("smolvlm", None, "<end_of_utterance>"),
    # tests/data/templates: families TRL has no training variant of (oracles written here), and the Qwen3 revision
    # hftrain's tests were written against (TRL's Qwen3 training variant is its oracle: the same rendering).
    _local("deepseek_r1", os.path.join(ORACLES, "deepseek_r1_training.jinja"), *DEEPSEEK),
    _local("llama3_1", os.path.join(ORACLES, "llama3_1_training.jinja"), "<|begin_of_text|>", "<|eot_id|>",
           LLAMA31_STOP),
    _local("llama3_2", os.path.join(ORACLES, "llama3_2_training.jinja"), "<|begin_of_text|>", "<|eot_id|>",
           LLAMA31_STOP),
    _local("mistral", os.path.join(ORACLES, "mistral_training.jinja"), "<s>", "</s>"),
    Family("qwen3_0_6b", os.path.join(LOCAL, "qwen3.jinja"), os.path.join(TRL_TEMPLATES, "qwen3_training.jinja"), None,
           "<|im_end|>", CHATML_STOP),
    # GLM-4.5 from a tokenizer alone (no generation_config.json beside it): its eos_token is <|endoftext|>, and the
    # template's turn-ending tokens (<|user|>, <|observation|>) are known from the template only.
    Family("glm4moe_tokenizer_only", os.path.join(TRL_TEMPLATES, "glm4moe.jinja"),
           os.path.join(TRL_TEMPLATES, "glm4moe_training.jinja"), None, "<|endoftext|>",
           ("<|endoftext|>", "<|user|>", "<|observation|>"), generation_config=False),
]}

# Control tokens as templates write them: <|x|>, <｜x｜>, [INST], Gemma 4's <|x> and <x|>, and tags of one word
# (<think>, <start_of_turn>, <tool_call>, ...), each a single id in the real tokenizers.
CONTROL = re.compile(r"<\|[^<>|\s'\"]+\|>|<｜[^｜<>]+｜>|\[/?(?:INST|SYSTEM_PROMPT|TOOL_CALLS|AVAILABLE_TOOLS)\]"
                     r"|<\|[a-z_]+>|<[a-z_]+\|>|</?[a-z_]+>|\[gMASK\]|<sop>|<\|\"\|>")
CORPUS = [
    "Be brief. Weather in Paris? It is sunny. And tomorrow? Rain. get_weather city sunny Paris",
    "I should look it up. The tool says sunny. You are a helpful assistant. system user assistant model tool",
    "Let me think. 2 + 3 = 5. The answer is 5. Hello, how can I help? Thanks, bye. function arguments name",
    "Café naïve résumé: 東京 は 晴れ 🌞 — fine. Still here. Tomorrow it rains. Good night.",
]
_base: dict = {}


def _base_tokenizer():
    if "tok" not in _base:
        _base["tok"] = train_tokenizer(CORPUS * 20, vocab_size=600)
    return _base["tok"]


def control_tokens(*templates: str) -> list[str]:
    return sorted({t for text in templates for t in CONTROL.findall(text)})


def read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def tokenizer_for(family: Family, folder: str, trim_offsets: bool = False, oracle: bool = False):
    """The family's tokenizer with its own (or its oracle's) template; `folder` gets its generation_config.json and
    becomes the tokenizer's name_or_path. The post-processor trims offsets or not (both conventions exist in real
    tokenizers: GPT-2's ByteLevel trims, Qwen2's and Llama 3's do not)."""
    own, marked = read(family.template), read(family.oracle)
    tok = copy.deepcopy(_base_tokenizer())
    specials = control_tokens(own, marked) + [t for t in (family.bos, family.eos, *family.stop) if t]
    tok.add_tokens(sorted(set(specials)), special_tokens=True)
    tok.bos_token, tok.eos_token = family.bos, family.eos
    tok.chat_template = marked if oracle else own
    backend = tok.backend_tokenizer
    backend.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=trim_offsets),
                                                  backend.post_processor])
    os.makedirs(folder, exist_ok=True)
    if family.generation_config:
        stop = [tok.convert_tokens_to_ids(t) for t in (family.stop or (family.eos,))]
        with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as fh:
            json.dump({"eos_token_id": stop}, fh)
    tok.name_or_path = folder
    return tok
