"""One rank of bench/data_scale.py: hftrain (recipes/sft.py's sequence) or TRL's SFTTrainer on an alpaca-layout
JSONL file, up to the end of the first optimizer step; writes the wall time at that moment and the rank's peak RSS.

    accelerate launch ... bench/data_scale_worker.py {hftrain|trl} {prepared|streaming} MODEL DATA OUT_JSON [NUM_PROC]
"""

import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

MAX_LENGTH, BATCH = 512, 8


class FirstStep(TrainerCallback):
    """At the end of optimizer step 1: the time and this rank's peak RSS, then stop."""

    def __init__(self, out: str, rank: int):
        self.out, self.rank = out, rank

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
            with open(f"{self.out}.rank{self.rank}.tmp", "w") as fh:
                json.dump({"first_step_at": time.time(), "peak_rss": me.ru_maxrss * 1024,
                           # CPU seconds of this rank and of the workers it waited for (datasets' num_proc pool):
                           # the work done, whatever else the machine runs
                           "cpu_s": me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime,
                           # memory of this rank alone at that moment: RSS also counts mapped pages of the cache
                           # files, which the page cache holds once for every rank
                           "uss": psutil.Process().memory_full_info().uss}, fh)
            os.replace(f"{self.out}.rank{self.rank}.tmp", f"{self.out}.rank{self.rank}")
            control.should_training_stop = True
        return control


def alpaca_to_chat(row: dict) -> dict:
    """What hftrain makes of an alpaca row with a chat template (data/layouts.py), as TRL's conversational
    prompt-completion: the answer alone is trained, as in hftrain."""
    user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return {"prompt": [{"role": "user", "content": user}],
            "completion": [{"role": "assistant", "content": row["output"]}]}


def run_hftrain(mode: str, model: str, data: str, out: str, num_proc: str | None) -> None:
    from hftrain.launch import check_data, setup_run
    from hftrain.modeling import load_model
    from hftrain.methods.sft import SFTTrainer

    raw = {"model": {"name_or_path": model, "dtype": "float32"},
           "data": {"sources": [{"path": data}], "max_length": MAX_LENGTH, "streaming": mode == "streaming",
                    **({"num_proc": int(num_proc)} if num_proc else {})},
           "training": {"output_dir": f"{out}.run", "max_steps": 1, "per_device_train_batch_size": BATCH,
                        "save_strategy": "no", "report_to": "none", "disable_tqdm": True, "logging_steps": 1}}
    run = setup_run([], raw=raw)
    tokenizer, data_ = check_data(run.recipe, run.args.world_size, seed=run.args.seed)
    trainer = SFTTrainer(
        model=load_model(run.recipe.model), args=run.args, train_dataset=data_.train, processing_class=tokenizer,
        data_collator=data_.collator, callbacks=[FirstStep(out, run.args.process_index)])
    trainer.train()


def run_trl(mode: str, model: str, data: str, out: str, num_proc: str | None) -> None:
    import datasets
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    state = PartialState()
    args = SFTConfig(output_dir=f"{out}.run", max_length=MAX_LENGTH, max_steps=1, per_device_train_batch_size=BATCH,
                     save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=1, use_cpu=True,
                     dataset_num_proc=int(num_proc) if num_proc else None, seed=0)
    with state.main_process_first():
        ds = datasets.load_dataset("json", data_files=data, split="train", streaming=mode == "streaming")
        columns = ["instruction", "input", "output"]
        ds = ds.map(alpaca_to_chat, remove_columns=columns, **({} if mode == "streaming" else
                                                                {"num_proc": int(num_proc) if num_proc else None}))
    tok = AutoTokenizer.from_pretrained(model)
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model), args=args, train_dataset=ds,
                         processing_class=tok, callbacks=[FirstStep(out, state.process_index)])
    trainer.train()


if __name__ == "__main__":
    impl, mode, model, data, out = sys.argv[1:6]
    num_proc = sys.argv[6] if len(sys.argv) > 6 and sys.argv[6] != "-" else None
    (run_hftrain if impl == "hftrain" else run_trl)(mode, model, data, out, num_proc)
