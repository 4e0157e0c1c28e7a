"""The staged folder uploaded through huggingface_hub.HfApi (create_repo, create_branch, upload_folder), retried on
the errors worth retrying with a growing wait; a refused token or card is said at once, and after the last attempt
the command to run again is named."""

from __future__ import annotations

import os
import shlex
import time

from huggingface_hub.errors import HfHubHTTPError

from ..errors import HubError
from .stage import STAGE_MARKER


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


def upload_stage(output_dir: str, stage: str, files: list[str], hub, api, attempts: int, backoff_s: float) -> str:
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
