"""What `hftrain check` and the run's preflight say of `training.report_to`: every problem at once, before anything
loads. transformers alone would accept "all" (every tracker installed turned on, asked for or not) and refuse an
unknown name only when the trainer is built, after the data and the model; a tracker without its server or login
fails, or prompts, only at the first step."""

from __future__ import annotations

import os
import urllib.error
import urllib.request

from .names import ALL, KNOWN, NONE, installed, requested, without_credentials

KEY = "training.report_to"
OFFLINE_WANDB_MODES = ("offline", "dryrun", "disabled")
SERVER_TIMEOUT_S = 5


def report_to_problems(report_to, environment: bool = True) -> list[tuple[str, str]]:
    """(key, message) for each problem of a report_to value; `environment`: also what this machine says (each tracker
    installed, MLflow's server answering, W&B's login or offline mode)."""
    names = requested(report_to)
    if ALL in names:
        return [(KEY, f"'all' turns on every tracker installed here ({', '.join(installed()) or 'none today'}), "
                      "asked for or not; name the ones to report to, e.g. report_to: [tensorboard, mlflow]")]
    unknown = [n for n in names if n not in KNOWN]
    if not isinstance(report_to, str) and NONE in (report_to or []) and names:
        unknown.append(NONE)  # transformers reads "none" only alone; in a list it is an unknown tracker
    out = [(KEY, f"'{n}' is not a tracker transformers reports to; one of: {', '.join(KNOWN)}, or none"
                 + (" (alone, not in a list)" if n == NONE else "")) for n in unknown]
    if not environment or not names:
        return out
    present = installed()  # a tenth of a second (a look for each tracker's package): only when one is named
    for name in names:
        if name in unknown:
            continue
        if name not in present:
            out.append((KEY, f"'{name}' is not installed here: pip install {name}, or leave it out of report_to"))
        elif name in ENVIRONMENT_CHECKS:
            out += [(KEY, m) for m in ENVIRONMENT_CHECKS[name]()]
    return out


def mlflow_problems() -> list[str]:
    """MLflow's tracking server (MLFLOW_TRACKING_URI over http or https) answers its /health; a local store needs
    nothing."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith(("http://", "https://")):
        return []
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=SERVER_TIMEOUT_S) as answer:
            if answer.status == 200:
                return []
            said = f"HTTP {answer.status}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        said = str(getattr(e, "reason", e))
    return [f"'mlflow': MLFLOW_TRACKING_URI={without_credentials(uri)} does not answer ({said}); start the tracking "
            "server, or unset MLFLOW_TRACKING_URI to log to a local store"]


def wandb_problems() -> list[str]:
    """W&B online needs a login (WANDB_API_KEY or `wandb login`'s netrc entry): without one a run would fail, or
    wait for a prompt, at its first step."""
    if os.environ.get("WANDB_MODE", "").lower() in OFFLINE_WANDB_MODES or os.environ.get("WANDB_API_KEY"):
        return []
    netrc = os.environ.get("NETRC", os.path.expanduser("~/.netrc"))
    try:
        with open(netrc, encoding="utf-8") as f:
            if "api.wandb.ai" in f.read():
                return []
    except OSError:
        pass
    return ["'wandb' has no login here: run `wandb login` or set WANDB_API_KEY, or set WANDB_MODE=offline (and "
            "`wandb sync` the run folder later)"]


ENVIRONMENT_CHECKS = {"mlflow": mlflow_problems, "wandb": wandb_problems}
