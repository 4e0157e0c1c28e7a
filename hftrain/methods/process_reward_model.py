"""A process reward model as a scorer: GRPO's reward (`grpo.rewards: [{model: runs/prm, aggregate: min}]`) and
`hftrain score`'s (reward/step_scores.py, which reads each step's score). A token classifier with two labels (0:
incorrect step, 1: correct step), as `hftrain reward` with kind process trains it, scores each step of a completion;
`aggregate` makes the completion's reward of them: `min` (its weakest step: one wrong step spoils the answer) or
`last` (the last step's score: how the whole reasoning ends).

A completion is read as its training rows were (methods/reward_reading.py, the one contract both import): its text (a
conversation's: its last assistant turn) split at the step separator, blank pieces left out; the prompt (a text prompt
after the tokenizer's BOS, a conversation rendered with the PRM's chat template and its generation prompt), then each
step tokenised alone and followed by the separator's one token, with the PRM's own tokenizer (the policy's when they
are the same; another is said once, by RewardModel). A step's score is the softmax probability of label 1 at its
separator's token; a completion with no step is not scored (None: TRL counts it as no reward from this function).
Rows are padded on the right with an attention mask (a decoder numbers positions from a row's first token), in
batches of SCORE_BATCH, without gradients."""

from __future__ import annotations

import torch

from ..errors import DataError, RewardError
from ..heads import Head
from ..data.collate import right_padded
from .reward_reading import separator_problem, step_row, steps_of
from .reward_model import SCORE_BATCH, RewardModel, text_of

AGGREGATES = {"min": min, "last": lambda scores: scores[-1]}


class ProcessRewardModel(RewardModel):
    """A process reward model of `key` as a reward function: one score per completion, `aggregate` (min, last) of
    its steps' scores, the steps split at `separator`. The separator is refused when the PRM's tokenizer makes more
    than one token of it (it has no one position to be read at), or is not a fast tokenizer (no offsets)."""

    HEAD = Head.TOKEN_CLASSIFICATION

    def __init__(self, name, key, policy_tokenizer, chat_template_kwargs, conversational, cfg, aggregate: str,
                 separator: str):
        super().__init__(name, key, policy_tokenizer, chat_template_kwargs, conversational, cfg)
        self.aggregate, self.separator = AGGREGATES[aggregate], separator
        problem = separator_problem(self.tokenizer, separator)
        if problem:
            raise RewardError(f"{key.removesuffix('.model')}.step_separator: {problem} (with {name}'s tokenizer: use "
                              "the separator the process reward model was trained at)")

    def padding_id(self) -> int:
        """Any id will do: rows are padded on the right and masked, so no separator read sits after a pad."""
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def step_row(self, prompt, completion) -> tuple[list[int], list[int]] | None:
        """(ids, the index of each step's separator token) of prompt + steps (reward_reading); None for a completion
        with no step."""
        steps = steps_of(text_of(completion), self.separator)
        if not steps:
            return None
        try:
            row = step_row(prompt, steps, self.tokenizer, self.separator, self.template_kwargs)
        except DataError as e:  # a RewardError is raised on every rank at once (GroupTrainer), not here
            raise RewardError(f"{self.key}: {e}") from None
        return row["input_ids"], row["step_ends"]

    def step_scores(self, rows: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Each row's step scores (the probability of label 1, correct step, at each separator token), SCORE_BATCH
        rows a forward, right-padded and masked."""
        if self.model is None:
            self.load(torch.device("cpu"))
        device, out = self.model.device, []
        with torch.inference_mode():
            for start in range(0, len(rows), SCORE_BATCH):
                chunk = rows[start:start + SCORE_BATCH]
                batch = right_padded([row for row, _ in chunk], self.pad_token_id)
                logits = self.model(**{k: v.to(device) for k, v in batch.items()}).logits
                correct = logits.float().softmax(-1)[..., 1].cpu()
                out += [correct[i, ends].tolist() for i, (_, ends) in enumerate(chunk)]
        return out

    def __call__(self, prompts, completions, **_):
        rows = [self.step_row(p, c) for p, c in zip(prompts, completions)]
        scored = iter(self.step_scores([r for r in rows if r is not None]))
        return [None if r is None else self.aggregate(next(scored)) for r in rows]
