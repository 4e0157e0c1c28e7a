"""One rank of bench/memory.py: recipes/sft.py's pieces, with the resident set size read around them.

    accelerate launch --config_file accelerate_configs/<s>.yaml bench/memory_worker.py MODEL_DIR OUT STEPS NVME
"""

import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hftrain import distributed  # noqa: E402
from hftrain.artifacts import describe  # noqa: E402
from hftrain.data import build_datasets  # noqa: E402
from hftrain.launch import setup_run  # noqa: E402
from hftrain.launch.setup import launcher_strategy  # noqa: E402
from hftrain.modeling import load_model, load_tokenizer  # noqa: E402
from hftrain.methods.sft import SFTTrainer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def storage_bytes(tensors, seen: set) -> int:
    """Bytes of the storages behind `tensors` not yet in `seen` (each storage once, however many views use it);
    `seen` gains them, so one set across calls counts shared storages once."""
    total = 0
    for t in tensors:
        try:
            st = t.untyped_storage()
            key = st.data_ptr()
        except Exception:  # tensor subclasses without a plain storage (e.g. DTensor wrappers): their locals count
            continue
        if key and key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def tensor_bytes() -> int:
    """Bytes of every CPU tensor storage alive in this process: model states and the engine's buffers, without
    allocator slack or the libraries' own memory."""
    import torch

    return storage_bytes((o for o in gc.get_objects()
                          if isinstance(o, torch.Tensor) and o.device.type == "cpu" and not o.is_meta), set())


class StepTensors:
    """Tensor bytes at each optimizer step, when parameters, gradients and optimizer states all exist: for PyTorch
    engines after the step (before the Trainer drops the gradients), for DeepSpeed just before its engine steps (it
    steps inside backward and frees ZeRO-1/2's gradient partitions right after). The most seen is reported."""

    def __init__(self, base: int):
        self.base, self.most = base, 0

    def measure(self):
        self.most = max(self.most, tensor_bytes() - self.base)

    def wrap_deepspeed_step(self):
        from deepspeed.runtime.engine import DeepSpeedEngine

        step, outer = DeepSpeedEngine.step, self

        def measured_step(engine, *args, **kwargs):
            if engine.is_gradient_accumulation_boundary():
                outer.measure()
            return step(engine, *args, **kwargs)

        DeepSpeedEngine.step = measured_step

    def callback(self):
        from transformers import TrainerCallback

        outer = self

        class _Cb(TrainerCallback):
            def on_optimizer_step(self, args, state, control, **kwargs):
                outer.measure()

        return _Cb()


def main(model_dir: str, out: str, steps: str, nvme: str) -> None:
    overrides = [f"model.name_or_path={model_dir}", f"data.sources.0.path={REPO}/data/demo/train.jsonl",
                 "data.max_length=64", f"training.output_dir={out}", f"training.max_steps={steps}",
                 "training.per_device_train_batch_size=2", "training.save_strategy=no", "training.report_to=none",
                 "training.disable_tqdm=true", "training.logging_steps=1"]
    if launcher_strategy() == "zero_infinity":
        overrides.append(f"strategy.nvme_path={nvme}")
    run = setup_run(overrides, raw={})
    recipe, strategy, args = run.recipe, run.strategy, run.args
    tokenizer = load_tokenizer(recipe.model)
    data = build_datasets(recipe.data, tokenizer)
    gc.collect()
    before, tensors_before = rss(), tensor_bytes()
    at_step = StepTensors(tensors_before)
    if strategy.name.startswith("zero"):
        at_step.wrap_deepspeed_step()
    model = load_model(recipe.model)
    trainer = SFTTrainer(model=model, args=args, train_dataset=data.train, processing_class=tokenizer,
                         data_collator=data.collator, callbacks=[at_step.callback()])
    trainer.train()
    gc.collect()
    after = tensor_bytes() - tensors_before
    report = {"rss_before_model": before, "rss_after_train": rss(), "peak_rss": rss("VmHWM"),
              "tensor_bytes": max(after, at_step.most),
              "engine": describe(trainer, strategy)}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"mem_rank{distributed.rank()}.json"), "w") as fh:
        json.dump(report, fh)
    del trainer, model
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:5])
