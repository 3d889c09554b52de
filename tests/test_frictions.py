"""A newcomer's frictions (issue 24, item 4), each pinned where no other test file owns it."""

from __future__ import annotations

import io


def test_transformerstransformers_bars_are_silent_unless_asked(monkeypatch):
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from hosfl_dist.models.hf_load import transformers_bars

    before = gguf_utils.tqdm
    for shown in (False, True):
        err = io.StringIO()
        with transformers_bars(shown):
            for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...", file=err):
                pass
            for _ in hf_logging.tqdm(range(3), desc="Loading weights", file=err):
                pass
        assert ("de-quantizing" in err.getvalue() and "Loading weights" in err.getvalue()) is shown
    assert gguf_utils.tqdm is before and hf_logging._tqdm_hook is None  # put back as found
