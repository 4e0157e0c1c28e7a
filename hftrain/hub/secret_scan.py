"""Secrets that must never leave the machine, looked for in every file of a stage before it is uploaded."""

from __future__ import annotations

import os
import re

# Secrets that must never leave the machine: a Hub token ("hf_" + 34 letters/digits), private keys, and the token
# formats of common services (AWS access keys, GitHub, OpenAI-style "sk-" keys).
SECRETS = {
    "a Hugging Face token": re.compile(rb"\bhf_[A-Za-z0-9]{30,}\b"),
    "a private key": re.compile(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "an AWS access key": re.compile(rb"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
    "a GitHub token": re.compile(rb"\bgh[pousr]_[A-Za-z0-9]{36,}\b"),
    "an API key (sk-...)": re.compile(rb"\bsk-[A-Za-z0-9_-]{32,}\b"),
}


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
