"""Batches of image rows: token ids and labels padded on the right, the batch's images (any sizes) through the
processor's image processor in row order (its pixel values and, for Qwen-VL, each image's patch grid; for LLaVA-NeXT
each image's tiles and size), and the image-token types where the family's model reads them (families.py
token_types: Qwen-VL's mm_token_type_ids, Gemma 3's token_type_ids; 1 at image tokens)."""

from __future__ import annotations

import torch

from ..data.collate import right_padded
from ..errors import DataError
from .families import family_of, image_token_ids
from .images import open_rgb


class ImageRows:
    """The collator of image rows (labels.py: input_ids, labels, images)."""

    def __init__(self, processor):
        self.processor = processor
        tokenizer = processor.tokenizer
        if tokenizer.pad_token_id is None:
            raise DataError("the tokenizer has no pad token; batching image rows needs one")
        self.pad_token_id = tokenizer.pad_token_id
        self.image_token_id = image_token_ids(processor)[1]
        self.token_types = family_of(processor).token_types

    @staticmethod
    def check(features: list[dict]) -> None:
        if any("images" not in f for f in features):
            raise DataError("the image rows reached the collator without their images column: "
                            "training.remove_unused_columns: true drops it; remove that setting")

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        self.check(features)
        batch = right_padded([f["input_ids"] for f in features], self.pad_token_id,  # data/collate.py
                             labels=[f["labels"] for f in features])
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        images = [open_rgb(path) for f in features for path in f["images"]]
        if images:
            batch.update(self.processor.image_processor(images=images, return_tensors="pt"))
        if self.token_types:
            batch[self.token_types] = (input_ids == self.image_token_id).long() * attention_mask
        return batch
