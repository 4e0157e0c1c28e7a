"""`hftrain score RM PROMPTS --policy POLICY --best-of N`: best-of-n sampling judged by an outcome reward model. Each
prompt's N samples from the policy (its chat template, its generation settings: it stops at its end of turn), each
scored by the reward model as it reads a conversation (the scorer GRPO rewards with, methods/reward_model.py), the
best kept. The figures: the mean score of the first sample (what one sample gives) and of the best, and, where the
rows hold an answer, how often the first and the best sample say it. --output writes each prompt's samples, scores
and best as JSON lines: rejection-sampling data for a next round."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ...config import DataSource, ModelSection
from ...data import read_rows
from ...errors import DataError
from ...evaluate import prompt_ids
from ...modeling import load_model, load_tokenizer
from .pair_scores import checked_model
from .subsets import KEY, device_of, existing


@dataclass(frozen=True)
class BestOfN:
    prompts: int
    samples: int
    mean_first_score: float
    mean_best_score: float
    first_exact_match: float | None
    best_exact_match: float | None


@dataclass(frozen=True)
class Sampling:
    n: int
    max_new_tokens: int
    temperature: float
    seed: int


def prompt_and_answer(row: dict, where: str) -> tuple[list, str | None]:
    """A row's prompt messages (before its first answer) and that answer, if it has one."""
    messages = row.get("messages") if "messages" in row else row.get("prompt")
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages or []]
    cut = roles.index("assistant") if "assistant" in roles else len(roles)
    if not messages or cut == 0:
        raise DataError(f"{KEY}: {where}: no prompt (a `messages` conversation or a `prompt` before any answer)")
    answer = messages[cut].get("content") if cut < len(messages) else None
    return messages[:cut], answer if isinstance(answer, str) else None


def samples(policy, tokenizer, prompt: list, sampling: Sampling) -> list[str]:
    ids = torch.tensor([prompt_ids(tokenizer, {"messages": prompt})], device=policy.device)
    out = policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0,
                          temperature=sampling.temperature, max_new_tokens=sampling.max_new_tokens,
                          num_return_sequences=sampling.n, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)


def _mean(values: list) -> float:
    return sum(values) / len(values)


def best_of_n(reward_model: str, policy_name: str, path: str, sampling: Sampling, trust_remote_code: bool = False,
              device: str | None = None) -> tuple[BestOfN, list[dict]]:
    """(the figures, each prompt's record: prompt, samples, scores, best) of best-of-n over the rows at `path`."""
    existing(path, "prompts (messages or prompt rows)")
    rows = [prompt_and_answer(row, where) for where, row in read_rows(DataSource(path=path), KEY).iterate()]
    scorer = checked_model(reward_model, trust_remote_code)
    section = ModelSection(name_or_path=policy_name, dtype="float32", trust_remote_code=trust_remote_code)
    where = device_of(device)
    policy, tokenizer = load_model(section).eval().to(where), load_tokenizer(section)
    scorer.load(where)
    torch.manual_seed(sampling.seed)
    records = []
    for prompt, answer in rows:
        said = samples(policy, tokenizer, prompt, sampling)
        scores = scorer.score_ids(scorer.render([prompt] * len(said),
                                                [[{"role": "assistant", "content": s}] for s in said]))
        best = max(range(len(said)), key=scores.__getitem__)
        records.append({"prompt": prompt, "answer": answer, "samples": said, "scores": scores, "best": best})
    return figures(records, sampling.n), records


def figures(records: list[dict], n: int) -> BestOfN:
    answered = [r for r in records if r["answer"] is not None]

    def said_right(pick) -> float | None:
        return _mean([r["samples"][pick(r)].strip() == r["answer"].strip() for r in answered]) if answered else None

    return BestOfN(len(records), n, _mean([r["scores"][0] for r in records]),
                   _mean([r["scores"][r["best"]] for r in records]), said_right(lambda r: 0),
                   said_right(lambda r: r["best"]))


def as_lines(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)
