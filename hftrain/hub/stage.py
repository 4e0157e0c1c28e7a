"""The exact folder `hftrain push` uploads, staged from a finished run: the model repository's files by name (never
a symbolic link, never checkpoints, logs or pickles), hard-linked or copied, the model card written, validated, then
published as the stage folder. A stage folder is replaced only when hftrain staged it (its marker lists its files)."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

from ..constants import HARNESS_RESULTS_FILE, RECIPE_FILE, RUN_INFO_FILE, STRATEGIES
from ..errors import HubError
from .card import build_card
from .run_settings import run_recipe

CARD_FILE = "README.md"
# What a model repository needs, by name: everything else in output_dir (checkpoints, logs, pickles such as
# training_args.bin, and any file a user or tool left there) stays local.
ALLOWED = re.compile(
    r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|adapter_model\.safetensors"
    r"|config\.json|generation_config\.json|adapter_config\.json"
    r"|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json|tokenizer\.model"
    r"|vocab\.json|vocab\.txt|merges\.txt|chat_template\.(jinja|json)"
    rf"|{re.escape(RECIPE_FILE)}|{re.escape(RUN_INFO_FILE)}|{re.escape(HARNESS_RESULTS_FILE)}"
    r"|trainer_state\.json|curves\.png|expert_load\.png"
    rf"|({'|'.join(STRATEGIES)})\.(yaml|json))$")


def _shareable(folder: str, trust_remote_code: bool = False) -> tuple[list[str], list[str]]:
    """(files to upload, problems): allowed names that are plain files; a symlink among them is a problem (it is
    never followed: it could point anywhere on the machine). The model's own .py files go with trust_remote_code."""
    names, problems = [], []
    for f in sorted(os.listdir(folder)):
        if not (ALLOWED.match(f) or (trust_remote_code and f.endswith(".py"))) or ".tmp-" in f:
            continue
        path = os.path.join(folder, f)
        if os.path.islink(path):
            problems.append(f"{path} is a symbolic link (to {os.readlink(path)}); hftrain uploads plain files only: "
                            "replace it by the file itself")
        elif os.path.isfile(path):
            names.append(f)
    return names, problems


def _place(src: str, dst: str) -> None:
    """Hard link when possible (weights can be large; the run never rewrites a saved file in place), else copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


STAGE_MARKER = ".hftrain_stage.json"  # in a folder `hftrain push` staged: the files it put there (never uploaded)


def stage_problem(dest: str) -> str | None:
    """Why `dest` may not receive a new stage: hftrain replaces only a folder it made itself. Allowed: no such path,
    an empty folder, or a stage this command wrote earlier and nobody has added to since (its marker lists exactly
    the files in it). Anything else (the run's own folder, a checkpoint, a folder of yours) is refused, whatever
    it holds, before anything is written."""
    if not os.path.lexists(dest):
        return None
    if os.path.islink(dest) or not os.path.isdir(dest):
        return f"--stage-dir {dest} is not a folder; give a new or empty folder"
    names = sorted(os.listdir(dest))
    if not names:
        return None
    listed = _marker_files(dest)
    extra = [n for n in names if n != STAGE_MARKER and (listed is None or n not in listed
                                                          or not os.path.isfile(os.path.join(dest, n)))]
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        what = "files hftrain did not stage" if listed is None else "files added after hftrain staged it"
        return (f"--stage-dir {dest} holds {what} ({shown}): hftrain replaces only a folder it staged itself. "
                "Give --stage-dir a new or empty folder (e.g. a name of its own inside that one)")
    return None


def _marker_files(folder: str) -> set[str] | None:
    try:
        with open(os.path.join(folder, STAGE_MARKER), encoding="utf-8") as fh:
            files = json.load(fh)["files"]
        return set(files) if isinstance(files, list) and all(isinstance(f, str) for f in files) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stage_folder(output_dir: str, dest: str, merge_lora: bool = False, repo_id: str | None = None,
                 license: str | None = None, trust_remote_code: bool = False, validate=None) -> list[str]:
    """Write the exact folder to upload and publish it as `dest`: model files, run records, README.md card.

    The files are staged in a new temporary folder beside `dest` (made here), validated there (`validate(folder)`
    -> problems; a HubError with them, and the temporary folder removed, when any), then moved to `dest`, which
    must be new, empty, or an earlier stage of hftrain's (stage_problem): nothing else is ever removed. With
    merge_lora the model files come from output_dir/merged instead of the adapter. Returns the file names.
    """
    run_recipe(output_dir)
    dest = os.path.abspath(dest)
    problem = stage_problem(dest)
    if problem:
        raise HubError(problem)
    sources: dict[str, str] = {}
    if merge_lora:
        merged = os.path.join(output_dir, "merged")
        if not os.path.isdir(merged):
            raise HubError(f"{merged} is missing: merge_lora pushes the merged model that model.lora.merge: true "
                           "writes at the end of training; rerun with it, or push the adapter")
        names, problems = _shareable(merged, trust_remote_code)
        if problems:
            raise HubError(problems)
        sources = {f: os.path.join(merged, f) for f in names}
    names, problems = _shareable(output_dir, trust_remote_code)
    if problems:
        raise HubError(problems)
    for f in names:
        if merge_lora and f.startswith("adapter_"):
            continue
        sources.setdefault(f, os.path.join(output_dir, f))
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    partial = tempfile.mkdtemp(prefix=".hftrain-stage-", dir=parent)  # this call's own folder
    try:
        for f, src in sorted(sources.items()):
            _place(src, os.path.join(partial, f))
        files = sorted([*sources, CARD_FILE])
        build_card(output_dir, files, repo_id=repo_id, license=license, merged=merge_lora).save(
            os.path.join(partial, CARD_FILE))
        problems = validate(partial) if validate is not None else []
        if problems:
            raise HubError(problems, header=f"refusing to push {output_dir}: {len(problems)} problem(s), nothing "
                                            "uploaded")
        with open(os.path.join(partial, STAGE_MARKER), "w", encoding="utf-8") as fh:
            json.dump({"files": files, "from": os.path.abspath(output_dir)}, fh)
        _publish_stage(partial, dest)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # made above, in this call
        raise
    return files


def _publish_stage(partial: str, dest: str) -> None:
    """Move the staged folder to `dest`. An earlier stage there (checked by stage_problem) is first moved into a
    folder made here for the purpose, then removed with it; an empty `dest` is removed with rmdir (empty only)."""
    if os.path.isdir(dest) and not os.listdir(dest):
        os.rmdir(dest)
    if not os.path.lexists(dest):
        os.rename(partial, dest)
        return
    problem = stage_problem(dest)  # again, just before replacing it
    if problem:
        raise HubError(problem)
    trash = tempfile.mkdtemp(prefix=".hftrain-old-stage-", dir=os.path.dirname(dest))
    os.rename(dest, os.path.join(trash, "stage"))
    os.rename(partial, dest)
    shutil.rmtree(trash)  # made above; holds only the earlier stage, which stage_problem showed to be hftrain's
