"""Vendor quirks of furlong.core, each version-gated with its reason and when to remove it.

- `empty_model`: transformers builds a model and then initialises every parameter at random
  (seconds to minutes for a large model, and every page written). A loader that overwrites every
  parameter wants the allocation only: transformers' own `initialization.no_init_weights` (5.x)
  skips the initialisation; buffers computed in `__init__` (rotary frequencies) are still computed.
  Because it also skips the weight tying of `post_init`, `tie_weights()` is called afterwards.
  The context patches module-level functions for its duration: loads must not run concurrently
  with another model's construction in the same process. Remove when transformers offers a public,
  thread-safe way to build a model without initialising it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import transformers


def empty_model(config: transformers.PretrainedConfig, dtype: torch.dtype) -> transformers.PreTrainedModel:
    """transformers' causal-LM class for `config`, in `dtype` on the CPU, parameters allocated
    but not initialised (their memory is whatever the allocator gave), weights tied as the config
    says."""
    import transformers
    from transformers import AutoModelForCausalLM

    if int(transformers.__version__.split(".")[0]) < 5:
        raise RuntimeError(f"furlong needs transformers >= 5, found {transformers.__version__}")
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model: transformers.PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
            config, dtype=dtype, trust_remote_code=False
        )
    model.tie_weights()
    return model
