"""Training without the split or the runtime: the same models and data, one process, ordinary backprop.

- :mod:`.pretrain`: a whole vision model's weights, saved in the layout ``model.pretrained`` loads
  (``python -m hosfl_dist.experiments.pretrain``);
- :mod:`.lora`: the first-order, unsplit LoRA reference of a language config
  (``python -m hosfl_dist.experiments.centralized_lora``).
"""
