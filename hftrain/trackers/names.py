"""The trackers `training.report_to` names, read as transformers reads it (TrainingArguments.__post_init__ and
integration_utils.get_reporting_integration_callbacks): one name, a list of names, "none", or "all"."""

from __future__ import annotations

import urllib.parse

from transformers.integrations.integration_utils import (INTEGRATION_TO_CALLBACK,
                                                         get_available_reporting_integrations)

KNOWN = tuple(INTEGRATION_TO_CALLBACK)  # every tracker transformers has a callback for
NONE = "none"
ALL = "all"


def requested(report_to) -> list[str]:
    """The names a report_to value lists, "none" left out ("all" kept: report_to_checks.py refuses it)."""
    if report_to is None:
        return []
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    return [n for n in names if n != NONE]


def installed() -> list[str]:
    """The trackers whose package this environment has (what "all" would turn on)."""
    return get_available_reporting_integrations()


def without_credentials(uri: str) -> str:
    """A tracking URI as it may be shown or written down: a user name and password in it left out."""
    parts = urllib.parse.urlsplit(uri)
    if not parts.netloc or "@" not in parts.netloc:
        return uri
    host = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
