"""A trained reward model as a GRPO reward (`grpo.rewards: [{model: runs/rm}]`): a sequence classifier with one label
(what AutoModelForSequenceClassification saves: an outcome reward model) scores each prompt + completion.

- Checked before anything loads (`reward_model_problems`, from `hftrain check` and the run alike): its config.json
  only, never the weights: a local folder that is not there, pickle-only weights, a model that is not a sequence
  classifier with one label. A token classifier with two labels (a process reward model, `hftrain reward` with
  kind process) is taken with `aggregate` (min or last) and its step separator (`step_separator`, else the
  `reward.step_separator` of the recipe.yaml its run wrote beside the weights): process_reward_model.py scores it;
  `aggregate` or `step_separator` on any other model is refused, as a token classifier without `aggregate` is.
- Loaded once per rank (`RewardModel.load`) through hftrain's own loader (modeling.load_model: safetensors only,
  remote code only with model.trust_remote_code, said first), whole on each rank (outside ZeRO-3's partitioning),
  in eval mode, without gradients, on the policy's device.
- The text it scores is read as it was trained (methods/reward_reading.py, the contract its training imports): when
  its tokenizer is the policy's (same vocabulary, same chat template), the very tokens the policy generated from (the
  prompt as rendered for generation + the completion ids: no decode and re-encode), completed with what the render
  writes after an answer (`answer_end`: the template's turn end, Qwen's `<|im_end|>` then `\n`; a text's EOS): the
  policy's tokens end at its EOS or where max_completion_length cut them, and a score read there is read at a
  position the model was never trained at (measured: a reward model at 0.77 held-out pair accuracy scored 0.48 on
  the same pairs ending at the EOS); otherwise the prompt and completion rendered with the reward model's own
  tokenizer and chat template (`outcome_ids`), said once. A differing tokenizer without a chat template is refused
  for conversation prompts (there is no way to render them as the reward model was trained).
- The score is the logit at the last real token: transformers' sequence classifiers find it from
  config.pad_token_id. A folder whose config has none takes its tokenizer's pad token (set on the config, and
  batches are padded with it); with neither, it is refused naming the folder: without it transformers reads the
  wrong position, or fails, as soon as two texts of different lengths share a batch.
Why hftrain's own and not TRL's model rewards (GRPOTrainer with a PreTrainedModel in reward_funcs): TRL re-renders
every completion from decoded text, scores the whole generation batch in one forward, sets pad = eos silently, and
under ZeRO-3 partitions the reward model; here the scores go through rewards.Reward's checks and deferred errors too.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import yaml
from huggingface_hub import try_to_load_from_cache
from transformers import AutoConfig, AutoTokenizer

from ..config import ModelSection, Problems
from ..constants import RECIPE_FILE
from ..distributed import print0
from ..errors import DataError, ModelError, RewardError
from ..heads import Head
from ..modeling import load_model, loading_outside_zero3, resolved_name_or_path
from ..data.collate import right_padded
from .reward_reading import answer_end, completed, outcome_ids

SCORE_BATCH = 16  # completions per forward of the reward model


def _looks_local(name: str) -> bool:
    """As modeling.paths judges model.name_or_path: a Hub id is "name" or "org/name", anything else a local path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


@dataclass(frozen=True)
class ProcessOptions:
    """What a recipe says of a process reward model (grpo.rewards.N): aggregate and step_separator, None: unset."""

    aggregate: str | None = None
    step_separator: str | None = None


def reward_model_problems(name: str, key: str, process: ProcessOptions = ProcessOptions()) -> Problems:
    """(key, message) for a reward model that cannot score: read from its config.json (and, for a process reward
    model, its recipe.yaml) alone (no weights loaded). A Hub id is checked when its config is in the local cache
    (else where it loads)."""
    folder = os.path.expanduser(name)
    if not os.path.isdir(folder):
        if _looks_local(name) or os.path.exists(folder):
            return [(key, f"{name} is not a folder (a local path: check the spelling, or train the reward model "
                     "first)")]
        cached = try_to_load_from_cache(name, "config.json")
        if not isinstance(cached, str):  # not in the local cache: the loader downloads it and says what is wrong
            return []
        folder = os.path.dirname(cached)
    return _folder_problems(folder, name, key, process)


def _folder_problems(folder: str, name: str, key: str, process: ProcessOptions) -> Problems:
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        return [(key, f"{name} has no readable config.json ({type(e).__name__}: {str(e)[:120]}); a reward model is "
                 "a folder saved by AutoModelForSequenceClassification.save_pretrained")]
    names = os.listdir(folder)
    if not any(n.endswith((".safetensors", ".safetensors.index.json")) for n in names) and any(
            n.endswith((".bin", ".pt", ".pth")) for n in names):
        return [(key, f"{name} holds pickle weights only; hftrain loads safetensors only (unpickling can run code): "
                 "load it with AutoModelForSequenceClassification and save_pretrained it once")]
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    spec = key.removesuffix(".model")  # grpo.rewards.N: the spec's other keys are named from it
    if any(a.endswith("ForTokenClassification") for a in architectures):
        return _process_problems(config, folder, name, key, process)
    out = [(f"{spec}.{option}", f"applies to a token-classification (process) reward model; {name} is not one "
            f"(architectures: {architectures or 'none'}): remove it") for option, value in
           (("aggregate", process.aggregate), ("step_separator", process.step_separator)) if value is not None]
    if out:
        return out
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        return [(key, f"{name} is not a sequence classifier (architectures: {architectures or 'none'}); a reward "
                 "model is a ...ForSequenceClassification with one label")]
    labels = len(config["id2label"]) if isinstance(config.get("id2label"), dict) else config.get("num_labels", 2)
    if labels != 1:
        return [(key, f"{name} has {labels} labels; a reward model scores with one (num_labels: 1)")]
    return []


def trained_separator(folder: str) -> str | None:
    """The step separator a process reward model was trained at: reward.step_separator of the resolved recipe.yaml
    that `hftrain reward` (kind process) writes beside the weights; None without one (e.g. a model from elsewhere)."""
    try:
        with open(os.path.join(folder, RECIPE_FILE), encoding="utf-8") as fh:
            reward = (yaml.safe_load(fh) or {}).get("reward")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    if isinstance(reward, dict) and reward.get("kind") == "process" and isinstance(reward.get("step_separator"), str):
        return reward["step_separator"]
    return None


def model_folder(name: str) -> str | None:
    """The local folder of a reward model: its path, or a Hub id's folder in the local cache; None when not here."""
    folder = os.path.expanduser(name)
    if os.path.isdir(folder):
        return folder
    cached = None if _looks_local(name) else try_to_load_from_cache(name, "config.json")
    return os.path.dirname(cached) if isinstance(cached, str) else None


def _process_problems(config: dict, folder: str, name: str, key: str, process: ProcessOptions) -> Problems:
    """A token classifier as a process reward model: two labels (0 incorrect step, 1 correct step), `aggregate` set,
    and a step separator: the recipe's, else its training run's (recipe.yaml), the two alike when both are given."""
    spec, out = key.removesuffix(".model"), []
    labels = len(config["id2label"]) if isinstance(config.get("id2label"), dict) else config.get("num_labels", 2)
    if labels != 2:
        out.append((key, f"{name} is a token classifier with {labels} labels; a process reward model has two "
                    "(0: incorrect step, 1: correct step), as hftrain reward with kind process trains it"))
    if process.aggregate is None:
        out.append((key, f"{name} is a token-classification (process) reward model: it scores each step, so say how "
                    f"the steps make a completion's reward: set {spec}.aggregate to min (its weakest step) or last "
                    "(its last step)"))
    trained = trained_separator(folder)
    if process.step_separator is None and trained is None:
        out.append((f"{spec}.step_separator", f"{name} has no {RECIPE_FILE} of a process reward run (hftrain reward, "
                    "kind process) naming the separator it was trained at: set step_separator to it (e.g. '\\n')"))
    elif process.step_separator is not None and trained is not None and process.step_separator != trained:
        out.append((f"{spec}.step_separator", f"{process.step_separator!r}, but {name} was trained at {trained!r} "
                    f"(reward.step_separator of its {RECIPE_FILE}): remove step_separator or set it to {trained!r}"))
    return out


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers render and encode alike: the same vocabulary (tokens and ids) and chat template."""
    return a.get_vocab() == b.get_vocab() and a.chat_template == b.chat_template


def _pad_token_id(name: str, key: str, tokenizer, trust_remote_code: bool) -> int:
    """The id the score's position is found from: config.pad_token_id, else the tokenizer's pad token; neither: a
    refusal naming the folder."""
    config = AutoConfig.from_pretrained(resolved_name_or_path(name), trust_remote_code=trust_remote_code)
    pad = config.get_text_config().pad_token_id
    pad = tokenizer.pad_token_id if pad is None else pad
    if pad is None:
        raise RewardError(f"{key}: {name} has no pad token (config.json's pad_token_id, or a pad token in its "
                          "tokenizer): its sequence classifier could not find the last real token of a padded text. "
                          "Set pad_token_id in its config.json (e.g. to its eos_token_id, as it was trained with)")
    return pad


def text_of(completion) -> str:
    """The text of a completion: itself, or the content of its last assistant message (a tool-using rollout is the
    assistant's turns with the tools' answers between them: the answer is the final turn, never a tool's output)."""
    if isinstance(completion, str):
        return completion
    said = [m.get("content") or "" for m in completion if m.get("role", "assistant") == "assistant"]
    return said[-1] if said else ""


_said: set[str] = set()


class RewardModel:
    """The reward model of `key` (`name`: its folder or Hub id), callable as a reward function: one score per
    completion. Its tokenizer and pad token are read (and refused) when it is built; its weights when `load` is
    called (GroupTrainer, once per rank), or on the first call. `rollout_ids`: the tokens the policy generated from,
    prompt + completion, handed over by the trainer for the call about to be made (used when the tokenizers are the
    same); without them each conversation is rendered with the reward model's tokenizer."""

    HEAD = Head.SEQUENCE_CLASSIFICATION  # what load() loads

    def __init__(self, name: str, key: str, policy_tokenizer, chat_template_kwargs: dict | None,
                 conversational: bool, cfg: ModelSection):
        self.name, self.key, self.cfg, self.model, self.rollout_ids = name, key, cfg, None, None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(resolved_name_or_path(name),
                                                           trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise RewardError(f"{key}: cannot load the tokenizer of {name} ({type(e).__name__}: {str(e)[:200]}); "
                              "save it beside the model (tokenizer.save_pretrained)") from None
        self.same = same_tokenizer(policy_tokenizer, self.tokenizer)
        if not self.same and conversational and not self.tokenizer.chat_template:
            raise RewardError(f"{key}: {name}'s tokenizer differs from the policy's (vocabulary or chat template) and "
                              "has no chat template to render the conversations with as it was trained: save its "
                              "tokenizer with its chat template, or train it with the policy's tokenizer")
        self.template_kwargs = chat_template_kwargs or {}
        self.answer_end = answer_end(self.tokenizer, conversational, self.template_kwargs) if self.same else []
        self.pad_token_id = self.padding_id()
        if not self.same and key not in _said:
            _said.add(key)
            print0(f"hftrain: {key}: {name}'s tokenizer differs from the policy's (vocabulary or chat template): "
                   "each completion is rendered again with its own tokenizer and chat template for it to score")

    def padding_id(self) -> int:
        """The id batches are padded with: the one the sequence classifier finds the last real token from."""
        return _pad_token_id(self.name, self.key, self.tokenizer, self.cfg.trust_remote_code)

    def load(self, device, args=None) -> None:
        """The weights, through modeling.load_model (safetensors, remote code only when model.trust_remote_code),
        whole on this rank (ZeRO-3's config set aside: `args`), on `device`, in eval mode without gradients."""
        section = ModelSection(name_or_path=self.name, dtype=self.cfg.dtype, kernels="none",
                               trust_remote_code=self.cfg.trust_remote_code)
        try:
            with loading_outside_zero3(args):
                model = load_model(section, head=self.HEAD)
        except ModelError as e:
            raise RewardError(str(e).replace("model.name_or_path", self.key)) from None
        model.config.pad_token_id = self.pad_token_id  # where transformers' classifier reads the score
        model.config.get_text_config().pad_token_id = self.pad_token_id
        self.model = model.eval().requires_grad_(False).to(device)

    def render(self, prompts: list, completions: list) -> list[list[int]]:
        """Each prompt + completion as the reward model reads it (methods/reward_reading.py outcome_ids: as it was
        trained), with its own tokenizer."""
        try:
            return [outcome_ids(self.tokenizer, p, c, self.template_kwargs, self.key)
                    for p, c in zip(prompts, completions)]
        except DataError as e:  # a RewardError is raised on every rank at once (GroupTrainer), not here
            raise RewardError(str(e)) from None

    def score_ids(self, rows: list[list[int]]) -> list[float]:
        """The score (the one label's logit) of each token sequence, SCORE_BATCH at a time, right-padded with the
        pad id the model reads the last real token from (the tokenizer's own pad() would pad with the tokenizer's
        pad token, which need not be the config's)."""
        if self.model is None:
            self.load(torch.device("cpu"))
        device, out = self.model.device, []
        with torch.inference_mode():
            for start in range(0, len(rows), SCORE_BATCH):
                batch = right_padded(rows[start:start + SCORE_BATCH], self.pad_token_id)  # read before the first pad
                logits = self.model(**{k: v.to(device) for k, v in batch.items()}).logits
                out += logits[:, 0].float().tolist()
        return out

    def __call__(self, prompts, completions, **_):
        handed = self.rollout_ids if self.same and self.rollout_ids is not None else None
        handed = [completed(r, self.answer_end) for r in handed] if handed is not None else None
        return self.score_ids(handed if handed is not None and len(handed) == len(completions)
                              else self.render(prompts, completions))
