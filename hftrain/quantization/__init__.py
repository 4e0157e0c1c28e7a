"""A base quantised by bitsandbytes, trained through a LoRA adapter (QLoRA: Dettmers et al. 2023).

transformers loads the base (its BitsAndBytesConfig), peft prepares it for training and trains the adapter;
bitsandbytes owns the kernels. What is hftrain's: the recipe's spelling (config.QuantizationSection), the
machine's check, the memory plan's bytes per parameter, and a merged model made from the *dequantised* base (the
weights the adapter was trained against), since peft's own merge into 4-bit layers quantises the sum again; the base
merged into is checked to be the packed base the run trained against (quantization.fingerprint).
"""

from .load import (bitsandbytes_problem, bnb_config, compute_dtype, keep_training_kernels, placement,
                   prepare_for_training)
from .fingerprint import FILE as FINGERPRINT_FILE
from .fingerprint import base_fingerprint, record_fingerprint
from .memory import quantized_linear_bytes
from .merge import checked_merged_model, merged_model
from .recorded import described as described_quantization
from .recorded import of_model as quantization_of_model
from .recorded import of_section as quantization_of_section

__all__ = ["bitsandbytes_problem", "bnb_config", "compute_dtype", "keep_training_kernels", "placement",
           "prepare_for_training", "quantized_linear_bytes", "merged_model",
           "checked_merged_model", "base_fingerprint", "record_fingerprint", "FINGERPRINT_FILE",
           "described_quantization", "quantization_of_model", "quantization_of_section"]
