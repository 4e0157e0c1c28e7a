"""One run of bench/long_context.py: recipes/sft.py's pieces on sequences of growing length, each optimizer step's
peak resident memory read per rank.

    python bench/long_context_worker.py MODEL_DIR OUT LENGTHS LOSS_IMPL CHECKPOINTING           (one process)
    accelerate launch --config_file accelerate_configs/zero3.yaml bench/long_context_worker.py ... --sp 2

Every example is LENGTHS[i] random tokens, all of them targets, one per step (micro-batch 1, no accumulation, plain
SGD: no optimizer state). Under sequence parallelism the group of 2 ranks trains one example per step, so each length
is given twice (one per rank's loader); with one process once. Before each step the peak (VmHWM) is reset
(/proc/self/clear_refs, Linux >= 4.0) and the resident set read; after it the peak: the step's own memory is their
difference. The driver sets MALLOC_MMAP_THRESHOLD_ so that freed tensors leave the resident set at once.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def main(model_dir: str, out: str, lengths: str, loss_impl: str, checkpointing: str, sp: int = 1) -> None:
    import datasets
    import torch
    from transformers import AutoTokenizer, TrainerCallback

    from hftrain import distributed
    from hftrain.data import make_collator
    from hftrain.launch import setup_run
    from hftrain.modeling import load_model
    from hftrain.methods.sft import SFTTrainer

    ladder = [int(x) for x in lengths.split(",")]
    per_step = [n for n in ladder for _ in range(sp)]  # the group trains one example per step
    overrides = [f"model.name_or_path={model_dir}", "model.dtype=float32",
                 f"model.gradient_checkpointing={checkpointing}", f"data.sources.0.path={REPO}/data/demo/train.jsonl",
                 f"data.max_length={max(ladder)}", f"training.output_dir={out}", f"training.max_steps={len(per_step)}",
                 "training.per_device_train_batch_size=1", "training.optim=sgd", "training.learning_rate=1e-4",
                 "training.save_strategy=no", "training.report_to=none", "training.disable_tqdm=true",
                 "training.logging_steps=1", "training.train_sampling_strategy=sequential",
                 f"training.loss_impl={loss_impl}", "training.overwrite_output_dir=true"]
    if sp > 1:
        overrides += ["strategy.name=zero3", f"strategy.sequence_parallel={sp}"]
    run = setup_run(overrides, raw={})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(run.recipe.model, sequence_parallel=sp)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in per_step]
    train = datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})
    steps: list[dict] = []

    class Memory(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            reset_peak()
            steps.append({"length": per_step[len(steps)], "rss_before": status("VmRSS"), "start": time.time()})

        def on_step_end(self, args, state, control, **kwargs):
            steps[-1].update(peak=status("VmHWM"), seconds=time.time() - steps[-1].pop("start"))

    trainer = SFTTrainer(model=model, args=run.args, train_dataset=train, processing_class=tokenizer,
                         data_collator=make_collator(tokenizer, packing=False), callbacks=[Memory()])
    trainer.train()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{distributed.rank()}.json"), "w") as fh:
        json.dump({"steps": steps, "loss": [h["loss"] for h in trainer.state.log_history if "loss" in h]}, fh)
    del trainer, model
    distributed.shutdown()


if __name__ == "__main__":
    args = sys.argv[1:]
    sp = 1
    if "--sp" in args:
        i = args.index("--sp")
        sp = int(args[i + 1])
        del args[i:i + 2]
    main(*args[:5], sp=sp)
