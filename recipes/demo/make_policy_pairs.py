"""Pairs for the reward-model demo made from the policy's own wrong answers (docs/reward.md, Demo).

    python recipes/demo/make_policy_pairs.py runs/demo/sft-partial data/demo/reward_policy.jsonl

Samples the partly trained SFT model (the GRPO policy's start) several times per prompt of
data/demo/reward_train.jsonl (seeded, CPU, transformers' generate) and writes one pair per distinct wrong sample:
chosen the right reversal, rejected the policy's own mistake. A reward model trained on the shipped pairs alone
misranks the mistakes this policy makes (a replaced middle letter), and GRPO optimises the policy into them; these
pairs put exactly those mistakes in the training data. The held-out pairs (data/demo/reward_eval.jsonl) are untouched.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SAMPLES_PER_PROMPT = 8
TEMPERATURE = 1.0
PROMPTS_PER_BATCH = 100


def sample_answers(policy: str, prompts: list[list[dict]]) -> list[list[str]]:
    """SAMPLES_PER_PROMPT answers per prompt, stripped, in prompt order."""
    tokenizer = AutoTokenizer.from_pretrained(policy)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    answers = []
    for start in range(0, len(texts), PROMPTS_PER_BATCH):
        batch = tokenizer(texts[start:start + PROMPTS_PER_BATCH], return_tensors="pt", padding=True,
                          add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, do_sample=True, temperature=TEMPERATURE, top_k=0, max_new_tokens=16,
                                 num_return_sequences=SAMPLES_PER_PROMPT, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        answers += [a.strip() for a in tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:],
                                                                skip_special_tokens=True)]
    return [answers[i:i + SAMPLES_PER_PROMPT] for i in range(0, len(answers), SAMPLES_PER_PROMPT)]


def main(policy: str, output: str) -> None:
    torch.manual_seed(0)
    rows = [json.loads(line) for line in open("data/demo/reward_train.jsonl")]
    seen, unique = set(), []
    for row in rows:
        if row["prompt"][0]["content"] not in seen:
            seen.add(row["prompt"][0]["content"])
            unique.append(row)
    groups = sample_answers(policy, [row["prompt"] for row in unique])
    pairs = []
    for row, answers in zip(unique, groups):
        right = row["chosen"][0]["content"]
        for wrong in dict.fromkeys(a for a in answers if a and a != right):  # an empty answer is no pair
            pairs.append({"prompt": row["prompt"], "chosen": row["chosen"],
                          "rejected": [{"role": "assistant", "content": wrong}]})
    with open(output, "w") as handle:
        handle.writelines(json.dumps(pair) + "\n" for pair in pairs)
    print(f"{len(unique)} prompts x {SAMPLES_PER_PROMPT} samples: {len(pairs)} pairs of a wrong sample -> {output}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
