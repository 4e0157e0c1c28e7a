"""Sharing a finished run on the Hub: validate the exact folder, write its model card, upload it with retries.

    output_dir ──► stage_folder ──► <output_dir>/hub_upload/  (weights, tokenizer, configs, README.md card)
                                         │ validate_folder: refused with every problem, nothing uploaded
                                         ▼
                   push ──► huggingface_hub.HfApi: create_repo(exist_ok) + upload_folder, bounded retries

The token is read by huggingface_hub (HF_TOKEN or the stored `hf auth login`); hftrain never writes or prints it.
Nothing here speaks HTTP itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import tempfile
import time

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from .. import distributed
from ..config import HubSection, Recipe
from ..config.rules import hub_problems, repo_id_problem
from ..constants import RECIPE_FILE, RUN_INFO_FILE, STRATEGIES
from ..errors import HubError
from .card import build_card
from .checks import adapter_problems, head_of_run, validate_folder

STAGE_DIR = "hub_upload"  # inside output_dir: the exact folder uploaded, kept for inspection
CARD_FILE = "README.md"
NO_TOKEN = ("no Hugging Face token found: set HF_TOKEN in the environment or run `hf auth login` on this machine "
            "(a recipe never holds the token)")
# What a model repository needs, by name: everything else in output_dir (checkpoints, logs, pickles such as
# training_args.bin, and any file a user or tool left there) stays local.
ALLOWED = re.compile(
    r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|adapter_model\.safetensors"
    r"|config\.json|generation_config\.json|adapter_config\.json"
    r"|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json|tokenizer\.model"
    r"|vocab\.json|vocab\.txt|merges\.txt|chat_template\.(jinja|json)"
    rf"|{re.escape(RECIPE_FILE)}|{re.escape(RUN_INFO_FILE)}|trainer_state\.json|curves\.png|expert_load\.png"
    rf"|({'|'.join(STRATEGIES)})\.(yaml|json))$")
# Secrets that must never leave the machine: a Hub token ("hf_" + 34 letters/digits), private keys, and the token
# formats of common services (AWS access keys, GitHub, OpenAI-style "sk-" keys).
SECRETS = {
    "a Hugging Face token": re.compile(rb"\bhf_[A-Za-z0-9]{30,}\b"),
    "a private key": re.compile(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "an AWS access key": re.compile(rb"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
    "a GitHub token": re.compile(rb"\bgh[pousr]_[A-Za-z0-9]{36,}\b"),
    "an API key (sk-...)": re.compile(rb"\bsk-[A-Za-z0-9_-]{32,}\b"),
}


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


def token_problems(folder: str, token: str | None) -> list[str]:
    """Files that hold a secret (this machine's Hub token, or anything shaped like a token or a private key): they
    must not be uploaded."""
    out = []
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            continue  # binary weights
        with open(os.path.join(folder, f), "rb") as fh:
            data = fh.read()
        found = ["the Hugging Face token of this machine"] if token and token.encode() in data else []
        found += [what for what, pattern in SECRETS.items() if pattern.search(data)]
        if found:
            out.append(f"{f} contains {' and '.join(dict.fromkeys(found))}: remove it from the run's files (tokens "
                       "belong in the environment or `hf auth login`, never in a recipe or config) and revoke it")
    return out


def _retryable_errors() -> tuple[type[BaseException], ...]:
    """What an unreachable or failing Hub raises through huggingface_hub (its HTTP client's transport errors)."""
    types: list[type[BaseException]] = [HfHubHTTPError, OSError]
    for mod in ("httpx2", "httpx"):  # huggingface_hub's HTTP client, whichever this version uses
        try:
            types.append(__import__(mod).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(types)


def _status(e: BaseException) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def push(output_dir: str, hub, *, dry_run: bool = False, stage_dir: str | None = None, endpoint: str | None = None,
         attempts: int = 3, backoff_s: float = 2.0, trust_remote_code: bool = False) -> str:
    """Validate and upload output_dir as `hub.repo_id` (a `HubSection`). Returns the commit URL (the staged folder
    for a dry run). Raises HubError: nothing uploaded when validation fails; after `attempts` failed uploads the
    local files are untouched and the same command can simply be run again.
    """
    if not hub.repo_id:
        raise HubError("no repository named: pass --repo-id your-name/model-name (or set hub.repo_id in the recipe)")
    problem = repo_id_problem(hub.repo_id)
    if problem:
        raise HubError(problem)
    token = None
    if not dry_run:
        token = get_token()  # HF_TOKEN, else the stored login
        if not token:
            raise HubError(NO_TOKEN)
    stage = os.path.abspath(stage_dir or os.path.join(output_dir, STAGE_DIR))
    merged_ref = os.path.join(output_dir, "merged")
    head = head_of_run(output_dir)  # the trained model's head, as run_info.json records it

    def validate(folder: str) -> list[str]:
        if hub.merge_lora:  # the merged model pushed must equal base + the run's adapter
            problems = (validate_folder(folder, trust_remote_code=trust_remote_code, head=head)
                        + adapter_problems(output_dir, folder, head))
        else:
            problems = validate_folder(folder, merged_ref if os.path.isdir(merged_ref) else None, trust_remote_code,
                                       head)
        return problems + token_problems(folder, token)

    files = stage_folder(output_dir, stage, hub.merge_lora, hub.repo_id, hub.license, trust_remote_code, validate)
    print(f"hftrain: validated {stage} ({len(files)} files): " + ", ".join(files), flush=True)
    if dry_run:
        print(f"hftrain: dry run: this folder is what `hftrain push` would upload to {hub.repo_id}", flush=True)
        return stage

    return _upload(output_dir, stage, files, hub, HfApi(endpoint=endpoint, token=token), attempts, backoff_s)


def _upload(output_dir: str, stage: str, files: list[str], hub, api, attempts: int, backoff_s: float) -> str:
    """The staged folder uploaded, retried on the errors worth retrying; the commit URL."""
    message = hub.commit_message or f"hftrain: upload {os.path.basename(os.path.normpath(output_dir))}"
    retryable = _retryable_errors()
    last = None
    for attempt in range(1, attempts + 1):
        try:
            api.create_repo(hub.repo_id, private=hub.private, exist_ok=True)
            if hub.revision:
                api.create_branch(hub.repo_id, branch=hub.revision, exist_ok=True)
            info = api.upload_folder(repo_id=hub.repo_id, folder_path=stage, revision=hub.revision,
                                     commit_message=message, ignore_patterns=[STAGE_MARKER])
            print(f"hftrain: pushed {len(files)} files to {hub.repo_id}"
                  + (f" (branch {hub.revision})" if hub.revision else "") + f": {info.commit_url}", flush=True)
            return info.commit_url
        except ValueError as e:  # huggingface_hub's answer to a card the Hub refuses (not worth retrying)
            raise HubError(f"the Hub refused the upload to {hub.repo_id}: {e}") from None
        except retryable as e:
            if _status(e) in (401, 403):
                raise HubError(f"the Hub refused the token for {hub.repo_id} ({_one_line(e)}): use a token with write "
                               "access to that namespace (HF_TOKEN or `hf auth login`)") from None
            last = e
            if attempt < attempts:
                wait = backoff_s * 2 ** (attempt - 1)
                print(f"hftrain: push attempt {attempt}/{attempts} failed ({_one_line(e)}); retrying in {wait:g}s",
                      flush=True)
                time.sleep(wait)
    raise HubError(
        f"pushing to {hub.repo_id} failed {attempts} times; last error: {_one_line(last)}. Nothing local changed: "
        f"{output_dir} is complete and the validated upload is in {stage}. Run `{rerun_command(output_dir, hub)}` "
        "again once the Hub is reachable") from None


def rerun_command(output_dir: str, hub) -> str:
    cmd = ["hftrain", "push", output_dir, "--repo-id", hub.repo_id]
    cmd += ["--private"] if hub.private else []
    cmd += ["--revision", hub.revision] if hub.revision else []
    cmd += ["--commit-message", hub.commit_message] if hub.commit_message else []
    cmd += ["--merge-lora"] if hub.merge_lora else []
    cmd += ["--license", hub.license] if hub.license else []
    return " ".join(shlex.quote(c) for c in cmd)


def check_token(hub) -> None:
    """Before training: a run that will push needs a token now, not after hours of training."""
    if hub.push and not get_token():
        raise HubError(NO_TOKEN + " (hub.push is true)")


def push_after_training(recipe) -> str | None:
    """recipes/sft.py's last step when hub.push is set: the main process validates and uploads output_dir."""
    if not recipe.hub.push or not distributed.is_main_process():
        return None
    # The run's ZeRO-3 config stays registered with transformers while its TrainingArguments live; validation
    # loads the saved folder as a plain CPU model, not under zero.Init.
    unset_hf_deepspeed_config()
    return push(recipe.output_dir, recipe.hub, trust_remote_code=recipe.model.trust_remote_code)


def run_recipe(output_dir: str) -> str:
    """A finished run's recipe.yaml (the CLI reads it with the methods' sections: methods.load_recipe)."""
    path = os.path.join(output_dir, RECIPE_FILE)
    if not os.path.isfile(path):
        raise HubError(f"{output_dir} has no recipe.yaml: not a finished hftrain run (every recipe script writes it)")
    return path


def settings_for_run(recipe: Recipe, **overrides) -> HubSection:
    """The run's own `hub:` settings (its recipe.yaml, read: run_recipe) with the command line's values on top."""
    hub = recipe.hub if isinstance(recipe.hub, HubSection) else HubSection()
    hub = dataclasses.replace(hub, **{k: v for k, v in overrides.items() if v is not None})
    problems = [f"{k}: {m}" for k, m in hub_problems(dataclasses.replace(hub, push=False), recipe.model.lora)]
    if problems:
        raise HubError(problems, header="cannot push")
    return hub
