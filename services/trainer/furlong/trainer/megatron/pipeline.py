"""Pipeline stages of the megatron backend: each rank of a pipeline group holds a contiguous run
of the decoder's layers (the first stage also the embedding, the last the final norm and the output
layer) and a micro-batch flows through them in order.

One micro-batch at a time (no interleaving, so a pipeline of P stages idles (P - 1) / P of each
pass): in the forward each stage receives the previous stage's hidden states, runs its layers and
sends its own on; the last stage turns its logits into the scores the learner needs (log-probs and
entropy of the response tokens, `logprobs.LogProbs`) and broadcasts them over the pipeline group,
so that every stage computes the same loss from the same numbers. In the backward the gradient of
each stage's output comes from the next stage and the gradient of its input goes to the previous
one: the two autograd functions below carry them, so that `loss.backward()` on every rank runs the
whole pipeline's backward. Hidden states cross the stages in float32 (whatever the compute dtype),
scores in their own dtype. Only tensors of a micro-batch's size move (hidden states, per-token
scores), never logits.

Weight names: a stage's GPTModel numbers its layers from 0; `PipelineStage.global_name` gives the
one-rank model's names (layer indices offset by the stage's first layer), which the published
weights, exports and checkpoints use.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from furlong.trainer.logprobs import LogProbs, SupportViolation

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
# dtypes scores may come in, by the code their header carries
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PipelineStage:
    """This rank's stage: `rank` of `world` stages over `group`, holding layers
    [`first_layer`, `first_layer` + `num_layers`) of the model; the global ranks of its neighbours
    (None at either end) and of the last stage (the scores' source)."""

    rank: int
    world: int
    group: dist.ProcessGroup | None
    first_layer: int
    num_layers: int
    prev_rank: int | None
    next_rank: int | None
    last_rank: int

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world - 1

    def global_name(self, name: str) -> str:
        """The one-rank model's name of this stage's GPTModel tensor `name`."""
        match = _LAYER.match(name)
        if match is None or self.first_layer == 0:
            return name
        return f"decoder.layers.{int(match.group(1)) + self.first_layer}.{name[match.end() :]}"

    def local_name(self, name: str) -> str | None:
        """This stage's GPTModel name of the one-rank model's tensor `name` (None: another stage's
        layer; the caller knows which of the embedding, final norm and output layer it holds)."""
        match = _LAYER.match(name)
        if match is None:
            return name
        layer = int(match.group(1)) - self.first_layer
        if not 0 <= layer < self.num_layers:
            return None
        return f"decoder.layers.{layer}.{name[match.end() :]}"

    def receive_hidden(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The previous stage's output for this micro-batch, `shape` ([sequence, batch, hidden]),
        cast to `dtype`; in the backward its gradient goes back to that stage."""
        anchor = torch.empty(0, requires_grad=torch.is_grad_enabled())
        hidden: torch.Tensor = _FromPrevious.apply(anchor, self, shape)  # type: ignore[no-untyped-call]  # torch leaves Function.apply unannotated
        return hidden.to(dtype)

    def scores(
        self, output: torch.Tensor, score: Callable[[torch.Tensor], LogProbs], num_tokens: int
    ) -> LogProbs:
        """The micro-batch's scores on every stage. `output`: the last stage's logits, another
        stage's hidden states (sent on to the next stage here); `score` runs on the last stage
        only, and `num_tokens` is the length of the scores it returns. A `SupportViolation` raised
        by `score` is raised on every stage."""
        if not self.is_last:
            assert self.next_rank is not None
            dist.send(output.detach().float().contiguous(), dst=self.next_rank, group=self.group)
            header = torch.zeros(4, dtype=torch.int64)
            dist.broadcast(header, src=self.last_rank, group=self.group)
            if header[0] < 0:
                raise SupportViolation(int(header[1]), int(header[2]), int(header[3]))
            if int(header[0]) != num_tokens:
                raise RuntimeError(
                    f"the last pipeline stage scored {int(header[0])} tokens, not {num_tokens}"
                )
            dtype = _DTYPES[int(header[1])]
            logprobs, entropy = _ScoresFromLast.apply(output, self, num_tokens, dtype)  # type: ignore[no-untyped-call]  # torch leaves Function.apply unannotated
            return LogProbs(logprobs, entropy)
        try:
            out = score(output)
        except SupportViolation as exc:
            failed = torch.tensor([-1, exc.row, exc.support_row, exc.token_id], dtype=torch.int64)
            dist.broadcast(failed, src=self.last_rank, group=self.group)
            raise
        dtype = out.logprobs.dtype
        if out.entropy.dtype != dtype or dtype not in _DTYPES:
            raise TypeError(
                f"scores of dtypes {out.logprobs.dtype} and {out.entropy.dtype} cannot be broadcast"
            )
        header = torch.tensor([out.logprobs.numel(), _DTYPES.index(dtype), 0, 0], dtype=torch.int64)
        dist.broadcast(header, src=self.last_rank, group=self.group)
        for t in (out.logprobs, out.entropy):
            dist.broadcast(t.detach().contiguous(), src=self.last_rank, group=self.group)
        return out

    def broadcast_from(
        self, stage: int, tensor: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype
    ) -> torch.Tensor:
        """`tensor` of stage `stage` on every stage of the group (a collective: every stage calls it;
        `tensor` is None on the others, which allocate `shape` and `dtype`). Several stages only."""
        assert self.group is not None
        src = dist.get_global_rank(self.group, stage)
        out = (
            tensor.detach().contiguous()
            if stage == self.rank and tensor is not None
            else torch.empty(shape, dtype=dtype)
        )
        dist.broadcast(out, src=src, group=self.group)
        return out


class _FromPrevious(torch.autograd.Function):
    """Forward: the previous stage's hidden states. Backward: their gradient sent back to it."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, stage: PipelineStage, shape: tuple[int, ...]) -> torch.Tensor:
        assert stage.prev_rank is not None
        hidden = torch.empty(shape, dtype=torch.float32)
        dist.recv(hidden, src=stage.prev_rank, group=stage.group)
        ctx.stage = stage
        return hidden

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        stage: PipelineStage = ctx.stage
        assert stage.prev_rank is not None
        dist.send(grad.float().contiguous(), dst=stage.prev_rank, group=stage.group)
        return None, None, None


class _ScoresFromLast(torch.autograd.Function):
    """Forward (a stage before the last): the last stage's scores, broadcast. Backward: the
    gradient of this stage's output (`output`, already sent on) from the next stage; the scores'
    own gradients are the last stage's business (every stage computes the same loss)."""

    @staticmethod
    def forward(
        ctx: Any, output: torch.Tensor, stage: PipelineStage, num_tokens: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs = torch.empty(num_tokens, dtype=dtype)
        entropy = torch.empty(num_tokens, dtype=dtype)
        for t in (logprobs, entropy):
            dist.broadcast(t, src=stage.last_rank, group=stage.group)
        ctx.stage, ctx.shape, ctx.dtype = stage, output.shape, output.dtype
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        stage: PipelineStage = ctx.stage
        assert stage.next_rank is not None
        grad = torch.empty(ctx.shape, dtype=torch.float32)
        dist.recv(grad, src=stage.next_rank, group=stage.group)
        return grad.to(ctx.dtype), None, None, None
