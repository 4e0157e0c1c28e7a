"""Generation-based evaluation: exact-match accuracy of greedy answers on held-out examples."""

from __future__ import annotations

import torch

from . import distributed
from .data.forms import template_messages
from .data.templates import template_kwargs
from .vision.image_answers import image_prompt_inputs


def prompt_ids(tokenizer, example: dict, chat_template_kwargs: dict | None = None, tools: list | None = None
               ) -> list[int]:
    """The ids a held-out example's answer is generated after: its messages with the generation prompt (and the
    schemas of `tools`), rendered with the same data.chat_template_kwargs (and pinned date) as training; or its plain
    prompt."""
    if "messages" in example:
        kwargs = template_kwargs(tokenizer, chat_template_kwargs)
        msgs = template_messages(example["messages"], tokenizer, kwargs, "eval.exact_match")
        return tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, return_dict=True,
                                             **kwargs)["input_ids"]
    return tokenizer(example["prompt"])["input_ids"]


def shard(n: int, rank: int, world: int, lockstep: bool) -> list[tuple[int, bool]]:
    """(example index, counted) for one rank: examples rank, rank + world, ...

    Under `lockstep` every rank must call generate() as often as the others (each forward is a collective), so the
    shorter shards end with a repeat of example 0 whose answer is not counted: each example is counted once."""
    mine = [(i, True) for i in range(rank, n, world)]
    if lockstep and n > 0:
        mine += [(0, False)] * (-(-n // world) - len(mine))
    return mine


def _generation_eos_ids(model, tokenizer) -> list[int]:
    """Where generation stops: the tokenizer's eos and the model's generation_config eos ids (which hold the
    template's end-of-turn token, data.templates.stop_at_end_of_turn)."""
    config = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if config is None else [config] if isinstance(config, int) else list(config)
    return list(dict.fromkeys([i for i in [tokenizer.eos_token_id, *ids] if i is not None]))


def greedy_settings(max_new_tokens: int, eos_token_id=None, pad_token_id=None) -> dict:
    """What greedy answers ask of generate(): the keywords it merges into the model's GenerationConfig and
    validates. `hftrain check` validates eval.max_new_tokens through these same settings (launch.libraries)."""
    return {"max_new_tokens": max_new_tokens, "do_sample": False, "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id}


@torch.no_grad()
def greedy_continuation(model, tokenizer, ids: list[int], max_new_tokens: int, synced: bool = False,
                        inputs: dict | None = None) -> list[int]:
    """The ids the model generates greedily after `ids`; `inputs`: the model's other inputs for that prompt (an
    image row's pixel values and grids, as its processor returns them: vision/image_answers.py)."""
    device = next(model.parameters()).device
    inp = torch.tensor([ids], device=device)
    out = model.generate(
        input_ids=inp,
        attention_mask=torch.ones_like(inp),
        synced_gpus=synced,
        **{k: v.to(device) for k, v in (inputs or {}).items()},
        **greedy_settings(max_new_tokens, _generation_eos_ids(model, tokenizer), tokenizer.pad_token_id),
    )
    return out[0, inp.shape[1]:].tolist()


def greedy_answer(model, tokenizer, example: dict, max_new_tokens: int, synced: bool = False,
                  chat_template_kwargs: dict | None = None) -> str:
    """The model's greedy answer to a held-out example's prompt (prompt_ids), decoded without special tokens. An
    example that carries images (vision.image_answers) is answered from its processor's inputs (`tokenizer` is then
    the run's processor: its text with the images' tokens, pixel values and grids)."""
    inputs = None
    if "images" in example:
        inputs = image_prompt_inputs(tokenizer, example, chat_template_kwargs)
        ids, tokenizer = inputs.pop("input_ids")[0].tolist(), tokenizer.tokenizer
    else:
        ids = prompt_ids(tokenizer, example, chat_template_kwargs)
    return tokenizer.decode(greedy_continuation(model, tokenizer, ids, max_new_tokens, synced, inputs),
                            skip_special_tokens=True)


def exact_match(model, tokenizer, examples: list[dict], max_new_tokens: int = 32, lockstep: bool = False,
                chat_template_kwargs: dict | None = None, answer=greedy_answer) -> float:
    """Share of `examples` whose greedy answer equals the reference (whitespace-stripped), each example once.

    Each rank generates its shard (`shard`) and the counts are summed over ranks. Sharded models (`lockstep`:
    FSDP, ZeRO-3) generate with `synced_gpus`: a rank whose answer is finished keeps stepping until every rank's is.
    `answer`: how an answer is generated (greedy_answer's arguments), e.g. over several turns with tools
    (methods/grpo/tools.py's ToolAnswer); it must call generate() as often on every rank under lockstep.
    """
    if not examples:
        return float("nan")
    was_training = model.training
    model.eval()
    synced = lockstep and distributed.world_size() > 1
    correct = 0
    for i, counted in shard(len(examples), distributed.rank(), distributed.world_size(), lockstep):
        said = answer(model, tokenizer, examples[i], max_new_tokens, synced, chat_template_kwargs)
        correct += int(counted and said.strip() == examples[i]["reference"].strip())
    if was_training:
        model.train()
    return distributed.all_reduce_sum(correct) / len(examples)
