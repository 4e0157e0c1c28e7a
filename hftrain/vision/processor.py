"""A vision-language model's processor (image processor + tokenizer + chat template), loaded the way transformers
loads it, with one exception said here: Qwen-VL's processors also hold a video processor, and transformers' video
processors need torchvision, which the CPU stack cannot import (FEASIBILITY.md, round 5: the wheel breaks
`import transformers`). Where the video processor cannot be built, hftrain builds the same processor class without
it (images only: hftrain trains on images, never videos); saved, it is the family's own processor class, which
AutoProcessor loads wherever torchvision is installed."""

from __future__ import annotations

from transformers import AutoProcessor
from transformers.utils import is_torchvision_available

from .families import CHECKED, model_type_of
from .families import processor_class as class_of_family


def images_only(processor_class: type) -> type:
    """`processor_class` (a Qwen-VL processor) without its video processor: the same __call__, chat template and
    image token, its __init__ taking (image_processor, tokenizer, chat_template) only. ProcessorMixin finds a
    processor's parts from its __init__'s parameters (get_attributes), so the video processor is never looked
    up."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # the family's own __init__ (its tokens and ids set as it sets them), handing ProcessorMixin a video
        # processor of None: ProcessorMixin pairs the parts it is given with get_attributes() (these two), so the
        # None is never checked nor kept
        processor_class.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    # Named as the family's own class: a save writes that name into processor_config.json and tokenizer_config.json
    # (ProcessorMixin names the tokenizer's processor class after its own), so AutoProcessor builds the family's class
    # where torchvision is installed, and load_processor this one where it is not; a name of hftrain's own there was
    # a class nothing else could load.
    return type(processor_class.__name__, (processor_class,), {"__init__": __init__, "__doc__": images_only.__doc__,
                                                               "__module__": __name__})


def needs_video_processor(processor_class: type) -> bool:
    return "video_processor" in processor_class.get_attributes()


def load_processor(name_or_path: str, processor_class: type | None = None, **kwargs):
    """The model's processor from its folder (a run's output_dir too): AutoProcessor's, or, where the family's class
    (`processor_class`, else the one of the folder's model type) needs a video processor and torchvision is not
    installed, that class without its video processor. The documented call for a saved Qwen-VL folder on such a
    machine: `from hftrain.vision import load_processor; load_processor(folder)`."""
    if processor_class is None:
        model_type = model_type_of(name_or_path)
        processor_class = class_of_family(model_type) if model_type in CHECKED else None
    if processor_class is None or not needs_video_processor(processor_class) or is_torchvision_available():
        return AutoProcessor.from_pretrained(name_or_path, **kwargs)
    return images_only(processor_class).from_pretrained(name_or_path, **kwargs)


def processor_of(section, data=None):
    """The processor of a model section's image-text-to-text model (a family hftrain has checked), its image size
    bounds those of the data section (data.image_min_pixels, image_max_pixels: checked by families.
    image_size_problems before), which a save of it keeps."""
    kwargs = {"revision": section.revision} if getattr(section, "revision", None) else {}
    processor = load_processor(section.name_or_path, class_of_family(model_type_of(section.name_or_path)), **kwargs)
    bounds = {edge: getattr(data, key, None) for edge, key in (("shortest_edge", "image_min_pixels"),
                                                                ("longest_edge", "image_max_pixels"))}
    if any(v is not None for v in bounds.values()):
        size = dict(processor.image_processor.size)
        processor.image_processor.size = {**size, **{k: v for k, v in bounds.items() if v is not None}}
    return processor
