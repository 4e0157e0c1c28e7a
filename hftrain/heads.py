"""The kinds of model a method holds, in a layer every module may import: a model's `Head` (which transformers Auto
class builds it, the Hub's pipeline tag, how the model card says to use it, whether it generates) and its `Role` in
a method (policy, reference, teacher, reward). A method declares its models by role and head
(methods/base.py: Method.models); loading, the memory plan, resume's checks, the upload checks and the card ask the
head instead of assuming a causal LM (tests/test_architecture.py: no module outside methods/ and this one names the
causal LM's Auto class or its pipeline tag)."""

from __future__ import annotations

import json
from enum import Enum

import transformers

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


class Head(str, Enum):
    """A model's head kind; its value is how run_info.json records it."""

    CAUSAL_LM = "causal_lm"
    SEQUENCE_CLASSIFICATION = "sequence_classification"
    TOKEN_CLASSIFICATION = "token_classification"
    IMAGE_TEXT_TO_TEXT = "image_text_to_text"

    @property
    def auto_class_name(self) -> str:
        """transformers' Auto class of this head, by name."""
        return {"causal_lm": "AutoModelForCausalLM", "sequence_classification": "AutoModelForSequenceClassification",
                "token_classification": "AutoModelForTokenClassification",
                "image_text_to_text": "AutoModelForImageTextToText"}[self.value]

    @property
    def auto_class(self) -> type:
        """transformers' Auto class that builds (from_config) and loads (from_pretrained) a model with this head."""
        return getattr(transformers, self.auto_class_name)

    @property
    def peft_auto_class_name(self) -> str:
        """peft's Auto class that loads a LoRA adapter of this head onto its base (peft.auto)."""
        return {"causal_lm": "AutoPeftModelForCausalLM",
                "sequence_classification": "AutoPeftModelForSequenceClassification",
                "token_classification": "AutoPeftModelForTokenClassification",
                "image_text_to_text": "AutoPeftModel"}[self.value]

    @property
    def peft_task_type(self) -> str:
        """peft's task type of a LoRA adapter on this head (peft.TaskType: a classifier's head is trained and saved
        whole, modules_to_save); a vision-language model's is its language model's."""
        return {"causal_lm": "CAUSAL_LM", "sequence_classification": "SEQ_CLS", "token_classification": "TOKEN_CLS",
                "image_text_to_text": "CAUSAL_LM"}[self.value]

    @property
    def pipeline_tag(self) -> str:
        """The Hub's pipeline tag of a model with this head (the card's metadata)."""
        return {"causal_lm": "text-generation", "sequence_classification": "text-classification",
                "token_classification": "token-classification", "image_text_to_text": "image-text-to-text"}[self.value]

    @property
    def generates(self) -> bool:
        """Whether the model answers with generate() (else it scores: logits per sequence or per token)."""
        return self in (Head.CAUSAL_LM, Head.IMAGE_TEXT_TO_TEXT)

    @property
    def scores_last_token(self) -> bool:
        """Whether the model reads one score per sequence at its last token before padding (config.pad_token_id,
        which loading sets from the tokenizer: modeling.model.score_pad_token)."""
        return self is Head.SEQUENCE_CLASSIFICATION

    def usage(self, ident: str, adapter: bool, num_labels: int | None = None, chat_template: bool = True) -> str:
        """The card's Python snippet: load `ident` (a LoRA adapter through peft: its base built with the classifier's
        `num_labels`, where the base config's own count differs) and prompt it once as it was trained (a sequence
        classifier: a conversation through the chat template where the tokenizer has one)."""
        name = json.dumps(ident)
        if self is Head.IMAGE_TEXT_TO_TEXT:
            return self._image_usage(name, adapter)
        labels = f", num_labels={num_labels}" if adapter and num_labels else ""
        if adapter:
            load = (f"from peft import {self.peft_auto_class_name}\nfrom transformers import AutoTokenizer\n\n"
                    f"model = {self.peft_auto_class_name}.from_pretrained({name}{labels})\n")
        else:
            load = (f"from transformers import {self.auto_class_name}, AutoTokenizer\n\n"
                    f"model = {self.auto_class_name}.from_pretrained({name})\n")
        load += f"tokenizer = AutoTokenizer.from_pretrained({name})\n"
        if self.generates:
            return load + _PROMPTS["generate"]
        if self is Head.SEQUENCE_CLASSIFICATION:
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

    @classmethod
    def recorded(cls, value: str | None) -> Head:
        """The head run_info.json records (methods.Method.card); a run written before heads were recorded trained a
        causal LM."""
        return cls(value) if value else cls.CAUSAL_LM


class Role(str, Enum):
    """What a model is to its method: the trained one is the policy."""

    POLICY = "policy"
    REFERENCE = "reference"
    TEACHER = "teacher"
    REWARD = "reward"
