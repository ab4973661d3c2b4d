"""Vendor quirks of furlong.core, each version-gated with its reason and when to remove it.

- `empty_model`: transformers builds a model and then initialises every parameter at random
  (seconds to minutes for a large model, and every page written). A loader that overwrites every
  parameter wants the allocation only: transformers' own `initialization.no_init_weights` (5.x)
  skips the initialisation; buffers computed in `__init__` (rotary frequencies) are still computed.
  Because it also skips the weight tying of `post_init`, `tie_weights()` is called afterwards.
  The context patches module-level functions (torch's init functions, `PreTrainedModel.init_weights`)
  for its duration and restores what it found on exit, so two such contexts interleaved by two
  threads leave the no-op functions in place for the rest of the process: every later model is
  built uninitialised and untied. `empty_model` therefore holds one process-wide lock around the
  context; a model built elsewhere in the process while a load runs can still see the no-ops.
  Remove when transformers offers a public, thread-safe way to build a model without
  initialising it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import transformers

_NO_INIT_LOCK = threading.Lock()


def empty_model(config: transformers.PretrainedConfig, dtype: torch.dtype) -> transformers.PreTrainedModel:
    """transformers' causal-LM class for `config`, in `dtype` on the CPU, parameters allocated
    but not initialised (their memory is whatever the allocator gave), weights tied as the config
    says."""
    import transformers
    from transformers import AutoModelForCausalLM

    if int(transformers.__version__.split(".")[0]) < 5:
        raise RuntimeError(f"furlong needs transformers >= 5, found {transformers.__version__}")
    from transformers.initialization import no_init_weights

    with _NO_INIT_LOCK, no_init_weights():
        model: transformers.PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
            config, dtype=dtype, trust_remote_code=False
        )
    model.tie_weights()
    return model
