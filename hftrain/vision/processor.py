"""A vision-language model's processor (image processor + tokenizer + chat template), loaded the way transformers
loads it, with one exception said here: Qwen-VL's processors also hold a video processor, and transformers' video
processors need torchvision, which the CPU stack cannot import (FEASIBILITY.md, round 5: the wheel breaks
`import transformers`). Where the video processor cannot be built, hftrain builds the same processor class without
it (images only: hftrain trains on images, never videos); saved, it is the family's own processor class, which
AutoProcessor loads wherever torchvision is installed."""

from __future__ import annotations

from transformers import AutoProcessor, ProcessorMixin
from transformers.utils import is_torchvision_available

from ..heads import Head
from .families import model_type_of, processor_class


def images_only(processor_class: type) -> type:
    """`processor_class` (a Qwen-VL processor) without its video processor: the same __call__, chat template and
    image token, its __init__ taking (image_processor, tokenizer, chat_template) only. ProcessorMixin finds a
    processor's parts from its __init__'s parameters (get_attributes), so the video processor is never looked
    up."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = getattr(tokenizer, "image_token_id", None) or tokenizer.convert_tokens_to_ids(
            self.image_token)
        self.video_token_id = getattr(tokenizer, "video_token_id", None) or tokenizer.convert_tokens_to_ids(
            self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    def to_dict(self) -> dict:
        # Saved as the family's own class: AutoProcessor builds that one where torchvision is installed.
        return dict(processor_class.to_dict(self), processor_class=processor_class.__name__)

    return type(f"{processor_class.__name__}ImagesOnly", (processor_class,),
                {"__init__": __init__, "to_dict": to_dict, "__doc__": images_only.__doc__})


def needs_video_processor(processor_class: type) -> bool:
    return "video_processor" in processor_class.get_attributes()


def load_processor(name_or_path: str, processor_class: type | None = None, **kwargs):
    """The model's processor from its folder: AutoProcessor's, or (`processor_class` given: the family's class,
    which needs a video processor, without torchvision here) that class without its video processor."""
    if processor_class is None or not needs_video_processor(processor_class) or is_torchvision_available():
        return AutoProcessor.from_pretrained(name_or_path, **kwargs)
    return images_only(processor_class).from_pretrained(name_or_path, **kwargs)


def processor_of(section):
    """The processor of a model section's image-text-to-text model (a family hftrain has checked)."""
    kwargs = {"revision": section.revision} if getattr(section, "revision", None) else {}
    return load_processor(section.name_or_path, processor_class(model_type_of(section.name_or_path)), **kwargs)


def arguments_for(head: Head, kwargs: dict) -> dict:
    """TrainingArguments values for a policy of this head: image rows keep their images column (the Trainer would
    drop a column the model's forward does not take)."""
    if head is Head.IMAGE_TEXT_TO_TEXT:
        kwargs = dict(kwargs)
        kwargs.setdefault("remove_unused_columns", False)
    return kwargs
