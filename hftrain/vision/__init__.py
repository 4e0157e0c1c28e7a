"""Vision-language fine-tuning (image-text-to-text models): the families hftrain has checked (families.py), the
processor (processor.py), images read and checked in the data phase (images.py), rows rendered by the processor
and labelled (rows.py), batches (collate.py), tiny models (tiny_models.py)."""
