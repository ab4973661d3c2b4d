"""Data parallelism of the torch backend over a torch.distributed group (gloo on CPU, NCCL on GPU).

Every rank is given the same batch; rank r trains on every world-th trainable row. Each rank's loss
is its share of the batch loss (the aggregation denominators are batch-wide), so gradients are
*summed* over the group, never averaged. Modes:

- `ddp` (default): the policy wrapped in `torch.nn.parallel.DistributedDataParallel` — bucketed
  gradient all-reduce overlapping the backward pass, with a summing comm hook; micro-batches before
  the last run under `no_sync()`, so one all-reduce per optimizer step.
- `fsdp2`: `torch.distributed.fsdp.fully_shard` on every decoder layer and on the root: parameters,
  gradients and AdamW state are sharded over the group (reduce-scatter, divide factor 1 = sum);
  the published state dict is gathered (`full_state`); training checkpoints are written sharded
  (`train_checkpoint`'s DCP format). Not for PPO (its value model is not sharded) and not with
  offload, which expects whole tensors.
- `allreduce`: no wrapper; the flattened gradients are all-reduced once before the optimizer step.

DDP and FSDP2 run collectives inside forward/backward, so every rank must run the same number of
passes: `plan` gives every rank the same number of micro-batches (each at most `micro_batch_size`
rows); a rank left with fewer rows than passes runs a zero-weighted pass over the batch's first
row. Knows nothing about objectives or samples beyond their count.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

MODES = ("ddp", "fsdp2", "allreduce")
T = TypeVar("T")


def _sum_hook(group, bucket):  # type: ignore[no-untyped-def]  # DDP checks a hook's annotations at run time, and they are strings here
    """DDP comm hook: all-reduce a bucket (a dist.GradBucket) as a sum (DDP's default divides by
    the world size)."""
    future = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return future.then(lambda f: f.value()[0])


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    body = getattr(model, "base_model", None) or getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


class DataParallel:
    """One rank's view of a data-parallel group for one policy model."""

    def __init__(self, model: torch.nn.Module, group: dist.ProcessGroup, mode: str = "ddp") -> None:
        """Wraps (ddp) or shards in place (fsdp2) `model`; build the optimizer afterwards, over
        `model.parameters()` (fsdp2 replaces them with sharded ones)."""
        if mode not in MODES:
            raise ValueError(f"data_parallel mode must be one of {list(MODES)}, got {mode!r}")
        self.group = group
        self.mode = mode
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.forward_module: torch.nn.Module = model
        self.device = next(model.parameters()).device  # where collectives' own tensors are made
        if mode == "ddp":
            ddp = torch.nn.parallel.DistributedDataParallel(
                model, process_group=group, broadcast_buffers=False
            )
            ddp.register_comm_hook(group, _sum_hook)
            self.forward_module = ddp
        elif mode == "fsdp2":
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import FSDPModule, fully_shard

            device = next(model.parameters()).device.type
            mesh = DeviceMesh.from_group(group, device_type=device)
            for layer in _decoder_layers(model):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            for module in model.modules():  # both setters act on one FSDP unit, not its children
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)
                    # A custom factor is a PREMUL_SUM reduction, which gloo lacks ("Cannot use
                    # ReduceOp.PREMUL_SUM with Gloo"): plain SUM, the (unit) scaling done apart.
                    module.set_force_sum_reduction_for_comms(True)
        log.info("data parallel %s: rank %d of %d", mode, self.rank, self.world)

    @property
    def reduces_in_backward(self) -> bool:
        return self.mode != "allreduce"

    def plan(self, rows: Sequence[T], micro_batch_size: int) -> list[tuple[list[T], bool]]:
        """This rank's micro-batches as (rows, is_padding). Every rank gets the same number when
        gradients are reduced inside backward (ddp, fsdp2)."""
        mine = list(rows[self.rank :: self.world])
        if not self.reduces_in_backward:
            return [(mine[i : i + micro_batch_size], False) for i in range(0, len(mine), micro_batch_size)]
        # The largest share is ceil(n / world) rows; that many passes of at most micro_batch_size.
        passes = max(1, math.ceil(math.ceil(len(rows) / self.world) / micro_batch_size))
        out = []
        for i in range(passes):
            chunk = mine[len(mine) * i // passes : len(mine) * (i + 1) // passes]
            out.append((chunk, False) if chunk else ([rows[0]], True))
        return out

    @contextlib.contextmanager
    def pass_context(self, last: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward: gradients are reduced on the last only."""
        if self.mode == "ddp" and not last:
            ddp = self.forward_module
            assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)  # wrapped in __init__
            with ddp.no_sync():
                yield
            return
        if self.mode == "fsdp2":
            from torch.distributed.fsdp import FSDPModule

            sharded = self.forward_module
            assert isinstance(sharded, FSDPModule)  # fully_shard made the model one in __init__
            sharded.set_requires_gradient_sync(last)
        yield

    def sum_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """All-reduce (sum) the gradients of params that no wrapper reduces: every parameter in
        `allreduce` mode, extra ones (a value model) otherwise."""
        sum_gradients(params, self.group)

    def sum_floats(self, values: list[float]) -> list[float]:
        totals = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(totals, group=self.group)
        return totals.tolist()


def sum_gradients(params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup) -> None:
    """Sum the gradients of `params` over `group` in one all-reduce (a missing gradient counts as
    zeros: a rank without rows, or a parameter its rows did not reach)."""
    if not params:
        return
    grads: list[torch.Tensor] = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p, grad in zip(params, grads):
        grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2-sharded DTensor (a collective: every rank must call it); the
    tensor itself otherwise."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
