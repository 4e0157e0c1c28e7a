"""What the teacher's files say before anything loads (hftrain check and the run alike, through the section's
launch_problems): its tokenizer must be the student's (the same vocabulary: tokens and ids; distilling across
tokenizers is not built), and its vocabulary size may differ from the student's only by padding rows beyond the
tokenizer (`shared_vocab`: the trainer slices both models' logits to it and says so)."""

from __future__ import annotations

import os

from transformers import AutoTokenizer

from ...config import ModelSection, Problems, Recipe
from ...modeling import local_config, resolved_name_or_path


def tokenizer_folder(cfg: ModelSection) -> str:
    return cfg.tokenizer_name_or_path or cfg.name_or_path


def _vocab(cfg: ModelSection) -> dict | None:
    """The saved tokenizer's vocabulary (token -> id) from local files only, or None when it cannot be read here (the
    path checks say why)."""
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_folder(cfg), revision=cfg.revision, local_files_only=True,
                                            trust_remote_code=cfg.trust_remote_code)
    except Exception:  # noqa: BLE001 - any reason: path_problems names a missing or broken folder
        return None
    return tok.get_vocab()


def shared_vocab(student_size: int, teacher_size: int, tokenizer_size: int) -> int | None:
    """The vocabulary both models' logits are compared over: their common size, or, where the sizes differ only by
    padding rows beyond the tokenizer's tokens, the tokenizer's size; None when one model has fewer rows than the
    tokenizer has tokens."""
    if student_size == teacher_size:
        return student_size
    if min(student_size, teacher_size) >= tokenizer_size:
        return tokenizer_size
    return None


SAMPLED_BYTES = 65536  # of each weight file's start and end, compared with its size: a copy, not another model


def _weight_files(folder: str) -> dict[str, int] | None:
    if not os.path.isdir(folder):
        return None
    return {f: os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors")}


def _ends(path: str) -> bytes:
    with open(path, "rb") as fh:
        head = fh.read(SAMPLED_BYTES)
        fh.seek(max(0, os.path.getsize(path) - SAMPLED_BYTES))
        return head + fh.read()


def same_weights(student: ModelSection, teacher: ModelSection) -> bool:
    """Whether the teacher is the student's own model: the same local folder, or a copy of its weights (the same
    safetensors files, sizes, and first and last bytes: a fine-tuned model differs everywhere). Hub ids not here:
    the same id and revision."""
    a, b = (resolved_name_or_path(m.name_or_path) for m in (student, teacher))
    if os.path.realpath(a) == os.path.realpath(b):
        return student.revision == teacher.revision or os.path.isdir(a)
    files = _weight_files(a), _weight_files(b)
    if not files[0] or files[0] != files[1]:
        return False
    return all(_ends(os.path.join(a, f)) == _ends(os.path.join(b, f)) for f in files[0])


def teacher_is_the_student(recipe: Recipe) -> Problems:
    """A teacher that is the student's own weights gives a divergence of 0 to a full student, or to a LoRA student
    at its start, which then never moves: refused where the loss is the divergence alone (with
    distill.ce_weight > 0 in logits mode it holds the student near its start while the cross-entropy trains it)."""
    d = recipe.distill
    if d.mode == "logits" and (d.value("ce_weight") or 0) > 0:
        return []
    if not same_weights(recipe.model, d.teacher):
        return []
    return [("distill.teacher", f"{d.teacher.name_or_path} is the student's own model ({recipe.model.name_or_path}: "
             "the same weights), so the divergence to it is 0 and nothing trains: name the larger or better model "
             "to learn from, or, to keep a student near its start while it learns the completions, set "
             "distill.ce_weight > 0 (logits mode)")]


def teacher_problems(recipe: Recipe) -> Problems:
    """The teacher's tokenizer against the student's, and their vocabulary sizes (both read from this machine's
    files; what cannot be read is left to the path checks); a teacher that is the student itself."""
    student, teacher = recipe.model, recipe.distill.teacher
    if not isinstance(student, ModelSection) or not isinstance(teacher, ModelSection):
        return []
    itself = teacher_is_the_student(recipe)
    if itself:
        return itself
    student_vocab, teacher_vocab = _vocab(student), _vocab(teacher)
    if student_vocab is None or teacher_vocab is None:
        return []
    if student_vocab != teacher_vocab:
        only = len(set(teacher_vocab.items()) ^ set(student_vocab.items()))
        return [("distill.teacher", f"the teacher's tokenizer ({tokenizer_folder(teacher)}) differs from the "
                 f"student's ({tokenizer_folder(student)}): {only} (token, id) entries are in one vocabulary only "
                 f"({len(teacher_vocab)} and {len(student_vocab)} tokens); distillation compares the two models' "
                 "distributions token by token, so they must share a tokenizer (cross-tokenizer distillation is not "
                 "built): choose a teacher of the student's family")]
    student_config, teacher_config = local_config(student), local_config(teacher)
    sizes = [getattr(c, "vocab_size", None) for c in (student_config, teacher_config)]
    if None in sizes or shared_vocab(*sizes, len(student_vocab)) is not None:
        return []
    return [("distill.teacher", f"the teacher's vocabulary size ({sizes[1]}, {teacher.name_or_path}) differs from "
             f"the student's ({sizes[0]}, {student.name_or_path}) by more than padding: one has fewer rows than the "
             f"tokenizer's {len(student_vocab)} tokens; choose models whose embeddings cover the tokenizer")]
