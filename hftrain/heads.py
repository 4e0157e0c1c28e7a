"""The kinds of model a method holds, in a layer every module may import: a model's `Head` (which transformers Auto
class builds it, the Hub's pipeline tag, how the model card says to use it, whether it generates) and its `Role` in
a method (policy, reference, teacher, reward). A method declares its models by role and head
(methods/base.py: Method.models); loading, the memory plan, resume's checks, the upload checks and the card ask the
head instead of assuming a causal LM (tests/test_architecture.py: no module outside methods/ and this one names the
causal LM's Auto class or its pipeline tag)."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

# How a snippet on the card prompts each head's model once it is loaded (`model`, `tokenizer`).
_PROMPTS = {
    # transformers 5's apply_chat_template returns a BatchEncoding with return_tensors (tests/test_heads.py runs it).
    "generate": ('messages = [{"role": "user", "content": "Hello"}]\n'
                 "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, "
                 "return_tensors=\"pt\")\n"
                 "out = model.generate(**inputs, max_new_tokens=64)\n"
                 "print(tokenizer.decode(out[0][inputs[\"input_ids\"].shape[1]:]))\n"),
    "score": ('inputs = tokenizer("Hello", return_tensors="pt")\n'
              "print(model(**inputs).logits)\n"),
    # A sequence classifier trained by hftrain (a reward model) read each pair's side as TRL's RewardTrainer renders
    # it: the conversation through the chat template, scored at its last token; a text pair as prompt + answer + EOS.
    "score_conversation": ('messages = [{"role": "user", "content": "Hello"},\n'
                           '            {"role": "assistant", "content": "Hi!"}]\n'
                           "inputs = tokenizer.apply_chat_template(messages, return_dict=True, return_tensors=\"pt\")\n"
                           "print(model(**inputs).logits[0, 0].item())  # the conversation's score\n"),
    "score_text": ('inputs = tokenizer("Hello" + " Hi!" + tokenizer.eos_token, return_tensors="pt", '
                   "add_special_tokens=False)\n"
                   "print(model(**inputs).logits[0, 0].item())  # the answer's score\n"),
    # An image-text-to-text model reads its prompt through its processor (image processor + tokenizer + template).
    "image": ('messages = [{"role": "user", "content": [{"type": "image", "image": Image.open("image.png")},\n'
              '                                          {"type": "text", "text": "What is in the image?"}]}]\n'
              "inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, "
              "return_dict=True, return_tensors=\"pt\")\n"
              "out = model.generate(**inputs, max_new_tokens=64)\n"
              "print(processor.decode(out[0][inputs[\"input_ids\"].shape[1]:]))\n"),
}


@dataclass(frozen=True, eq=False)
class Head:
    """A model's head kind, a registered value (`Head.register`): the built-in ones below, and any a method outside
    hftrain registers from its module (a value head, an embedding model), which loading, the memory plan, resume's
    checks, the upload checks and the card then ask as they ask the built-in ones. Compared by identity: one object
    per value. `value` is how run_info.json records it."""

    value: str
    auto_class_name: str  # the Auto class that builds (from_config) and loads (from_pretrained) it
    peft_auto_class_name: str  # peft's Auto class that loads a LoRA adapter of this head onto its base (peft.auto)
    # peft's task type of a LoRA adapter on this head (peft.TaskType: a classifier's head is trained and saved whole,
    # modules_to_save); a vision-language model's is its language model's
    peft_task_type: str
    pipeline_tag: str  # the Hub's pipeline tag of a model with this head (the card's metadata)
    generates: bool = False  # answers with generate() (else it scores: logits per sequence or per token)
    # reads one score per sequence at its last token before padding (config.pad_token_id, which loading sets from the
    # tokenizer: modeling.model.score_pad_token)
    scores_last_token: bool = False
    reads_images: bool = False  # prompted through its processor with an image (the card's snippet)
    auto_class_module: str = "transformers"  # where auto_class_name is imported from (a plugin's own package)

    _registered: ClassVar[dict[str, Head]] = {}

    @classmethod
    def register(cls, head: Head) -> Head:
        """`head`, registered under its value; registering a value twice is refused (two heads, one record)."""
        if head.value in cls._registered:
            raise ValueError(f"a head named {head.value!r} is registered already; give the new head another value")
        cls._registered[head.value] = head
        return head

    @classmethod
    def registered(cls) -> tuple[Head, ...]:
        """Every head registered, the built-in ones first."""
        return tuple(cls._registered.values())

    @classmethod
    def recorded(cls, value: str | None) -> Head:
        """The head run_info.json records (methods.Method.card); a run written before heads were recorded trained a
        causal LM."""
        if not value:
            return cls.CAUSAL_LM
        if value not in cls._registered:
            raise ValueError(f"run_info.json records the head {value!r}, which no installed method registers (heads "
                             f"known: {', '.join(cls._registered)}); install the method that trained it")
        return cls._registered[value]

    @property
    def auto_class(self) -> type:
        """The Auto class that builds (from_config) and loads (from_pretrained) a model with this head."""
        return getattr(importlib.import_module(self.auto_class_module), self.auto_class_name)

    def __repr__(self) -> str:
        return f"Head({self.value!r})"

    def usage(self, ident: str, adapter: bool, num_labels: int | None = None, chat_template: bool = True) -> str:
        """The card's Python snippet: load `ident` (a LoRA adapter through peft: its base built with the classifier's
        `num_labels`, where the base config's own count differs) and prompt it once as it was trained (a sequence
        classifier: a conversation through the chat template where the tokenizer has one)."""
        name = json.dumps(ident)
        if self.reads_images:
            return self._image_usage(name, adapter)
        labels = f", num_labels={num_labels}" if adapter and num_labels else ""
        if adapter:
            load = (f"from peft import {self.peft_auto_class_name}\nfrom transformers import AutoTokenizer\n\n"
                    f"model = {self.peft_auto_class_name}.from_pretrained({name}{labels})\n")
        else:
            imports = (f"from transformers import {self.auto_class_name}, AutoTokenizer\n"
                       if self.auto_class_module == "transformers" else
                       f"from {self.auto_class_module} import {self.auto_class_name}\n"
                       "from transformers import AutoTokenizer\n")
            load = imports + f"\nmodel = {self.auto_class_name}.from_pretrained({name})\n"
        load += f"tokenizer = AutoTokenizer.from_pretrained({name})\n"
        if self.generates:
            return load + _PROMPTS["generate"]
        if self.scores_last_token:
            return load + _PROMPTS["score_conversation" if chat_template else "score_text"]
        return load + _PROMPTS["score"]

    def _image_usage(self, name: str, adapter: bool) -> str:
        """The snippet of an image-text-to-text model: its processor, an image, generate(). An adapter loads onto its
        base through peft's PeftModel (peft's AutoPeftModel refuses an adapter with a task type, and none of its
        task classes builds an image-text-to-text base)."""
        cls = self.auto_class_name
        if adapter:
            load = ("from PIL import Image\nfrom peft import PeftConfig, PeftModel\n"
                    f"from transformers import {cls}, AutoProcessor\n\n"
                    f"base = {cls}.from_pretrained(PeftConfig.from_pretrained({name}).base_model_name_or_path)\n"
                    f"model = PeftModel.from_pretrained(base, {name})\n")
        else:
            load = (f"from PIL import Image\nfrom transformers import {cls}, AutoProcessor\n\n"
                    f"model = {cls}.from_pretrained({name})\n")
        return load + f"processor = AutoProcessor.from_pretrained({name})\n" + _PROMPTS["image"]


Head.CAUSAL_LM = Head.register(Head("causal_lm", "AutoModelForCausalLM", "AutoPeftModelForCausalLM", "CAUSAL_LM",
                                    "text-generation", generates=True))
Head.SEQUENCE_CLASSIFICATION = Head.register(Head(
    "sequence_classification", "AutoModelForSequenceClassification", "AutoPeftModelForSequenceClassification",
    "SEQ_CLS", "text-classification", scores_last_token=True))
Head.TOKEN_CLASSIFICATION = Head.register(Head(
    "token_classification", "AutoModelForTokenClassification", "AutoPeftModelForTokenClassification", "TOKEN_CLS",
    "token-classification"))
Head.IMAGE_TEXT_TO_TEXT = Head.register(Head("image_text_to_text", "AutoModelForImageTextToText", "AutoPeftModel",
                                             "CAUSAL_LM", "image-text-to-text", generates=True, reads_images=True))


class Role(str, Enum):
    """What a model is to its method: the trained one is the policy."""

    POLICY = "policy"
    REFERENCE = "reference"
    TEACHER = "teacher"
    REWARD = "reward"
