"""A process reward model as a GRPO reward (`grpo.rewards: [{model: runs/prm, aggregate: min}]`): a token classifier
with two labels (0: incorrect step, 1: correct step), as `hftrain reward` with kind process trains it, scores each
step of a completion; `aggregate` makes the completion's reward of them: `min` (its weakest step: one wrong step
spoils the answer) or `last` (the last step's score: how the whole reasoning ends).

How it reads a completion, the way its training rows were built (methods/reward/step_rows.py):
- the steps: the completion's text (a conversation's: its last assistant turn) split at the step separator, blank
  pieces left out (a step row never has an empty step: training refuses one), each step followed by the separator,
  the last one too; a completion with no step is not scored (None: TRL counts it as no reward from this function);
- the text: the prompt (a text prompt after the tokenizer's BOS, a conversation rendered with the PRM's chat
  template and its generation prompt) then the steps, tokenised once as a whole with the PRM's own tokenizer (the
  policy's when they are the same; another is said once, by RewardModel);
- a step's score: the softmax probability of label 1 at its separator's token (found by the tokenizer's character
  offsets). Training refused a separator that merges with the text around it; a rollout cannot be refused, so
  such a separator is read at the token that holds its last character.
Rows are padded on the right with an attention mask (a decoder numbers positions from a row's first token), in
batches of SCORE_BATCH, without gradients.

Why the few lines that find the separators are written again here and not imported from step_rows.py: the GRPO
family does not import the reward family (each method is its own package: tests/test_architecture.py), and the
rule they share is the short one above."""

from __future__ import annotations

import torch

from ...data.templates import apply
from ...errors import DataError, RewardError
from ...heads import Head
from .reward_model import SCORE_BATCH, RewardModel, text_of

AGGREGATES = {"min": min, "last": lambda scores: scores[-1]}


def steps_of(text: str, separator: str) -> list[str]:
    """The steps of a completion's text: the pieces between separators, blank ones left out."""
    return [step for step in text.split(separator) if step.strip()]


class ProcessRewardModel(RewardModel):
    """A process reward model of `key` as a reward function: one score per completion, `aggregate` (min, last) of
    its steps' scores, the steps split at `separator`. The separator is refused when the PRM's tokenizer makes more
    than one token of it (it has no one position to be read at), or is not a fast tokenizer (no offsets)."""

    HEAD = Head.TOKEN_CLASSIFICATION

    def __init__(self, name, key, policy_tokenizer, chat_template_kwargs, conversational, cfg, aggregate: str,
                 separator: str):
        super().__init__(name, key, policy_tokenizer, chat_template_kwargs, conversational, cfg)
        self.aggregate, self.separator = AGGREGATES[aggregate], separator
        spec = key.removesuffix(".model")
        if not getattr(self.tokenizer, "is_fast", False):
            raise RewardError(f"{key}: {name}'s tokenizer is not a fast (tokenizers-backed) one, so the step "
                              "separators cannot be found by character offsets: save it with its fast tokenizer")
        tokens = self.tokenizer.tokenize(separator)
        if len(tokens) != 1:
            raise RewardError(f"{spec}.step_separator: {separator!r} is {len(tokens)} tokens {tokens} of {name}'s "
                              "tokenizer, so a step's score has no one token to be read at: use the separator the "
                              "process reward model was trained at (one token)")

    def padding_id(self) -> int:
        """Any id will do: rows are padded on the right and masked, so no separator read sits after a pad."""
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def rendered_prompt(self, prompt) -> tuple[str, list[int]]:
        """(text, ids before it), as the PRM's data phase: a text prompt after the BOS, a conversation rendered with
        the chat template and its generation prompt (the template writes its own special tokens)."""
        if isinstance(prompt, str):
            bos = self.tokenizer.bos_token_id
            return prompt, [bos] if bos is not None else []
        try:
            return apply(self.tokenizer, prompt, None, self.template_kwargs, self.key, tokenize=False,
                         add_generation_prompt=True), []
        except DataError as e:  # a RewardError is raised on every rank at once (GroupTrainer), not here
            raise RewardError(str(e)) from None

    def step_row(self, prompt, completion) -> tuple[list[int], list[int]] | None:
        """(ids, the index of each step's separator token) of prompt + steps; None for a completion with no step."""
        steps = steps_of(text_of(completion), self.separator)
        if not steps:
            return None
        text, before = self.rendered_prompt(prompt)
        ends = []
        for step in steps:
            text += step + self.separator
            ends.append(len(text) - 1)  # the separator's last character
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        tokens = [enc.char_to_token(end) for end in ends]
        if None in tokens:  # a tokenizer that drops the separator's characters (one that strips whitespace)
            raise RewardError(f"{self.key}: {self.name}'s tokenizer drops the step separator {self.separator!r} from "
                              "the text, so a step has no token to be read at")
        return before + enc.input_ids, [len(before) + token for token in tokens]

    def step_scores(self, rows: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Each row's step scores (the probability of label 1, correct step, at each separator token), SCORE_BATCH
        rows a forward, right-padded and masked."""
        if self.model is None:
            self.load(torch.device("cpu"))
        device, out = self.model.device, []
        with torch.inference_mode():
            for start in range(0, len(rows), SCORE_BATCH):
                chunk = rows[start:start + SCORE_BATCH]
                ids = torch.full((len(chunk), max(len(r[0]) for r in chunk)), self.pad_token_id, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for i, (row, _) in enumerate(chunk):
                    ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row, dtype=torch.long), 1
                logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
                correct = logits.float().softmax(-1)[..., 1].cpu()
                out += [correct[i, ends].tolist() for i, (_, ends) in enumerate(chunk)]
        return out

    def __call__(self, prompts, completions, **_):
        rows = [self.step_row(p, c) for p, c in zip(prompts, completions)]
        scored = iter(self.step_scores([r for r in rows if r is not None]))
        return [None if r is None else self.aggregate(next(scored)) for r in rows]
