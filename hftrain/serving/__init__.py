"""What a finished run is served as (`hftrain export`): merged safetensors of an adapter run (merged_run.py), GGUF
files through llama.cpp's own converter (gguf_files.py, run by gguf_runner.py), each loaded back and compared with
the trained model (gguf_check.py)."""

from .gguf_check import GgufCheck, check_gguf, trained_reference
from .gguf_files import GGUF_TYPES, convert, converter_dir, supported_architectures
from .merged_run import merged_folder

__all__ = ["GgufCheck", "check_gguf", "trained_reference", "GGUF_TYPES", "convert", "converter_dir",
           "supported_architectures", "merged_folder"]
