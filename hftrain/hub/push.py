"""Sharing a finished run on the Hub: validate the exact folder, write its model card, upload it with retries.

    output_dir ──► stage.stage_folder ──► <output_dir>/hub_upload/  (weights, tokenizer, configs, README.md card)
                                                │ checks.validate_folder, secret_scan.token_problems: refused
                                                │ with every problem, nothing uploaded
                                                ▼
                   upload.upload_stage ──► huggingface_hub.HfApi: create_repo(exist_ok) + upload_folder, retries

The token is read by huggingface_hub (HF_TOKEN or the stored `hf auth login`); hftrain never writes or prints it.
Nothing here speaks HTTP itself. run_settings reads a finished run's recipe and `hub:` settings for `hftrain push`.
"""

from __future__ import annotations

import os

from huggingface_hub import HfApi, get_token
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from .. import distributed
from ..config.rules import repo_id_problem
from ..errors import HubError
from .checks import adapter_base_options, adapter_problems, head_of_run, validate_folder
from .secret_scan import token_problems
from .stage import stage_folder
from .upload import upload_stage

STAGE_DIR = "hub_upload"  # inside output_dir: the exact folder uploaded, kept for inspection
NO_TOKEN = ("no Hugging Face token found: set HF_TOKEN in the environment or run `hf auth login` on this machine "
            "(a recipe never holds the token)")


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
    base = adapter_base_options(output_dir)  # an adapter's base as the run built it (classes, quantisation)

    def validate(folder: str) -> list[str]:
        if hub.merge_lora:  # the merged model pushed must equal base + the run's adapter
            problems = (validate_folder(folder, trust_remote_code=trust_remote_code, head=head)
                        + adapter_problems(output_dir, folder, head, base))
        else:
            problems = validate_folder(folder, merged_ref if os.path.isdir(merged_ref) else None, trust_remote_code,
                                       head, base)
        return problems + token_problems(folder, token)

    files = stage_folder(output_dir, stage, hub.merge_lora, hub.repo_id, hub.license, trust_remote_code, validate)
    print(f"hftrain: validated {stage} ({len(files)} files): " + ", ".join(files), flush=True)
    if dry_run:
        print(f"hftrain: dry run: this folder is what `hftrain push` would upload to {hub.repo_id}", flush=True)
        return stage

    return upload_stage(output_dir, stage, files, hub, HfApi(endpoint=endpoint, token=token), attempts, backoff_s)


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
