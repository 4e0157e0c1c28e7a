"""Preference tuning (DPO, IPO, SimPO, ORPO, KTO) of a causal LM from one YAML recipe with a `preference:` section;
its loss_type picks the method (hftrain/methods/preference/dpo.py, orpo.py, kto.py; their policy: methods/policy.py).

    hftrain dpo recipes/demo/dpo.yaml [key=value ...]
    accelerate launch --config_file accelerate_configs/ddp.yaml -m hftrain.recipes.dpo recipes/demo/dpo.yaml
    python -m hftrain.recipes.dpo recipes/demo/dpo.yaml training.max_steps=10      (one process)
"""

from hftrain.recipes import entry

main = entry("dpo")

if __name__ == "__main__":
    main()
