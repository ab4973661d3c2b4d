"""In which precision a run's models compute, as the REST run spec (`precision`) declares it: the
trainer trains and the rollout engines generate in `dtype`. The proto form is
`furlong.v1.PrecisionConfig`; where each service runs (its device) is the service's own flag, not a
run setting.

bfloat16 training keeps float32 master weights and float32 AdamW state and runs the forward under
`torch.autocast(bfloat16)` (matmuls in bf16, reductions and the log-prob/entropy path in float32);
the engines hold bfloat16 copies of the published float32 weights. `gradient_checkpointing`
recomputes each decoder layer's activations in the backward pass instead of keeping them (less
memory, one more forward per step).
"""

from __future__ import annotations

from dataclasses import dataclass

from furlong.core.settings.fields import check_fields, setting

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class PrecisionSettings:
    dtype: str = setting(
        "float32",
        choices=DTYPES,
        doc="compute dtype of the trainer (bfloat16: autocast over float32 master weights and "
        "optimizer state) and of the rollout engines",
    )
    gradient_checkpointing: bool = setting(
        False, doc="recompute activations in the trainer's backward pass instead of storing them"
    )

    def __post_init__(self) -> None:
        check_fields(self)
