"""The zeroth-order client's no-grad forward of f_c through ``torch.compile`` (``zo.compile``).

``torch.compile(module)`` shares the module: its parameters stay where they are, and Dynamo reads them from the
module's slots at every call as inputs of the compiled graph (``inline_inbuilt_nn_modules``, always on in torch
2.13), so a replica bound into the slots, a perturbed copy swapped in (``zo.perturb_mode=copy``) and an optimizer
step that writes θc in place are all seen (one recompile, for the copies' tensor type; ``tests/test_compile.py``).
No freezing: frozen weights would be constants of the graph.

What such a forward may not rely on is a hook added after it was compiled (``zo.perturb_mode=hooks``, the upcast of
half-precision weights under ``zo.compute_dtype``): Dynamo does not guard on submodules' hooks
(``skip_nnmodule_hook_guards``), so the compiled graph runs without them, silently (with hooks, every z̃ came out as
z: ``tests/test_compile.py``). Those are refused where the config is checked and where the worker is built.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hosfl_dist.config.schema import COMPILE_MODES
from hosfl_dist.errors import first_line
from hosfl_dist.models import Activation, as_activation


class CompiledForward:
    """f_c(x) as :meth:`~hosfl_dist.models.SplitModel.client_forward` computes it, through ``torch.compile(module,
    mode=mode)`` (built once; compiled at the first call and again for each new input shape or tensor type)."""

    def __init__(self, module: nn.Module, mode: str) -> None:
        if mode not in COMPILE_MODES[1:]:
            raise ValueError(f"unknown torch.compile mode {mode!r} (one of {', '.join(COMPILE_MODES[1:])})")
        self.mode = mode
        self.compiled = torch.compile(module, mode=mode)

    def __call__(self, inputs: Any) -> Activation:
        graphs = self.mode == "reduce-overhead"
        if graphs:  # each call a step of its own: a CUDA graph's replay writes its outputs' static buffers again
            torch.compiler.cudagraph_mark_step_begin()
        try:
            out = self.compiled(**inputs) if isinstance(inputs, dict) else self.compiled(inputs)
        except torch._dynamo.exc.TorchDynamoException as exc:  # the backend's and Dynamo's failures, not the model's
            cause = getattr(exc, "inner_exception", None) or exc  # a backend's error, under "backend=… raised:"
            raise RuntimeError(
                f"zo.compile={self.mode}: torch.compile could not compile the client's forward "
                f"({type(cause).__name__}: {first_line(cause)}); use zo.compile=off"
            ) from exc
        act = as_activation(out)
        # z is kept while the P z̃ run, and with latency hiding the z̃ too: copies, not the buffers the next replay
        # overwrites
        return {k: v.clone() for k, v in act.items()} if graphs else act
