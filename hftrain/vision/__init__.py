"""Vision-language fine-tuning (image-text-to-text models): the families hftrain has checked (families.py), the
processor (processor.py), images read and checked in the data phase (images.py), image rows in canonical form
(image_rows.py), rendered by the processor and labelled (labels.py), the datasets (image_datasets.py), batches
(image_batches.py), tiny models (tiny_models.py)."""
