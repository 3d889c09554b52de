"""A fine-tuned model out of its run: ``python -m hosfl_dist.export RUN_DIR --out DIR [--format merged|peft]``.

- :mod:`~hosfl_dist.export.restore`: a run's checkpoint (either runtime, FSDP-sharded or not) back into one process,
  verified and checked against the run;
- :mod:`~hosfl_dist.export.hf`: a split decoder LM as a Hugging Face folder (LoRA merged) or one PEFT adapter of the
  unsplit model;
- :mod:`~hosfl_dist.export.vision`: a split vision model as the whole model's state dict, and :func:`load_vision`;
- :mod:`~hosfl_dist.export.card`: the model card and ``hosfl_export.json``.

``python -m hosfl_dist.predict`` runs an exported LM on a JSONL file.
"""

from hosfl_dist.export.cli import export
from hosfl_dist.export.restore import ExportError, Restored, restore
from hosfl_dist.export.vision import load_vision

__all__ = ["ExportError", "Restored", "export", "load_vision", "restore"]
