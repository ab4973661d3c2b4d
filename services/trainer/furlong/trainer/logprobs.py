"""Per-token log-probs of sampled targets, renormalised over each token's sampling support, and the
entropy of the full (tempered) distribution — chunked over rows, with a hand-written backward.

The rollout sampler drew each token from softmax(logits / T) restricted to its support (top-k/top-p)
and renormalised; scoring the full vocabulary instead would bias every importance ratio by the kept
mass. `log_probs_with_support` replays the support: log p(target) = x_target - logsumexp_{support} x
with x = logits / T, and -inf outside it. Entropy stays over the whole vocabulary.

Memory: rows are processed `chunk_rows` at a time; each chunk gets a private float copy of its
logits (modified in place only there); shared logits are never written. The support's
log-sum-exp is taken over the support entries themselves (O(nnz), no dense vocabulary mask).
Forward saves four numbers per row besides the inputs and backward recomputes each chunk, so
working memory does not grow with the number of response tokens (the gradient of the logits is as
large as the logits).

Parallel layouts:
- tensor parallel (`vocab_shard`): `logits` hold vocabulary ids [start, start + V_local) of a
  vocabulary sharded across the ranks of `vocab_shard.group`; maxima, sums and the picked target
  are all-reduced (a shard holding none of a row's support contributes max -inf and sum 0).
- context parallel (`support_rows`): a rank holds some of a response's rows; `support_rows[i]` is
  the global response index of local row i, so the support is read from the response's full mask.
  `context_parallel_rows` gives the standard load-balanced split.

Knows nothing about models, samples or optimizers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from furlong.core.sampling_mask import RolloutSamplingMask

# A support's entries on this rank for a chunk's partial rows: (the rows' chunk indices, each
# entry's row among them, its local vocabulary id)
_Coords = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

DEFAULT_CHUNK_ROWS = 256


class LogProbs(NamedTuple):
    logprobs: torch.Tensor  # (N,) log p(target) over the support, work dtype (>= float32)
    entropy: torch.Tensor  # (N,) entropy of softmax(logits / T) over the full vocabulary


class SupportViolation(ValueError):
    """A target id lies outside its row's sampling support."""

    def __init__(self, row: int, support_row: int, token_id: int):
        self.row, self.support_row, self.token_id = row, support_row, token_id
        super().__init__(
            f"target id {token_id} at row {row} (response position {support_row}) "
            f"is outside its sampling support"
        )


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice [start, start + size) of a vocabulary of `vocab_size` ids, sharded over `group`."""

    group: object  # torch.distributed ProcessGroup
    start: int
    vocab_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.vocab_size:
            raise ValueError(f"vocab shard start {self.start} outside [0, {self.vocab_size})")


def context_parallel_rows(num_rows: int, rank: int, world_size: int) -> np.ndarray:
    """Global row indices held by `rank` when `num_rows` rows are split over `world_size` context-
    parallel ranks: 2*world chunks, rank r takes chunks r and 2*world-1-r (balances causal attention).
    The union over ranks is every row exactly once."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    bounds = np.linspace(0, num_rows, 2 * world_size + 1).round().astype(np.int64)
    first = np.arange(bounds[rank], bounds[rank + 1])
    other = 2 * world_size - 1 - rank
    return np.concatenate([first, np.arange(bounds[other], bounds[other + 1])]).astype(np.int64)


@dataclass
class ScoringPlan:
    """Everything forward and backward share, built once per call."""

    n: int
    temperature: float
    chunk_rows: int
    dtype: torch.dtype
    positions: torch.Tensor | None
    support: RolloutSamplingMask | None
    shard: VocabShard | None
    local_vocab: int
    support_rows: np.ndarray | None = None  # global response index of each row (context parallel)
    unique_positions: bool = True
    device: torch.device = torch.device("cpu")  # the logits' (every work tensor is made there)

    def chunks(self) -> Iterator[tuple[int, int]]:
        for a in range(0, self.n, self.chunk_rows):
            yield a, min(a + self.chunk_rows, self.n)

    def select_rows(self, t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Scored rows [a, b) of `t` (shaped like the scored tensor): a view, or a copy of the picked rows."""
        return t[a:b] if self.positions is None else t.index_select(0, self.positions[a:b])

    def scaled(self, logits2d: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """A private work-dtype copy of rows [a, b) divided by T (safe to modify in place)."""
        return self.divide_by_temperature(self.select_rows(logits2d, a, b).to(self.dtype, copy=True))

    def divide_by_temperature(self, t: torch.Tensor) -> torch.Tensor:
        """t divided by T in place (untouched when T is 1)."""
        return t if self.temperature == 1.0 else t.div_(self.temperature)

    def write_rows(self, out: torch.Tensor, rows: torch.Tensor, a: int, b: int) -> None:
        """Store (or, for repeated positions, add) the values of scored rows [a, b) into `out`,
        which is shaped like the scored tensor (the inverse of the row selection)."""
        if self.positions is None:
            out[a:b] = rows
        elif self.unique_positions:
            out.index_copy_(0, self.positions[a:b], rows)
        else:
            out.index_add_(0, self.positions[a:b], rows)

    def support_coords(self, a: int, b: int) -> _Coords | None:
        """For rows [a, b) whose support is not the whole vocabulary: (those rows' chunk indices,
        each support entry's row among them, its local vocabulary id), entries on this rank only.
        None when every row is the full vocabulary (then the full path is exact)."""
        assert self.support is not None  # callers ask only for a plan with a support
        sub = self.support.rows(a, b)
        lengths = sub.row_lengths()
        partial = np.flatnonzero(lengths < sub.vocab_size)
        if partial.size == 0:
            return None
        if partial.size < lengths.size:
            sub = sub.select(partial)
            lengths = lengths[partial]
        ids = torch.from_numpy(sub.token_ids.astype(np.int64)).to(self.device)
        rows = torch.from_numpy(np.repeat(np.arange(partial.size, dtype=np.int64), lengths)).to(self.device)
        if self.shard is not None:
            ids = ids - self.shard.start
            own = (ids >= 0) & (ids < self.local_vocab)
            ids, rows = ids[own], rows[own]
        return torch.from_numpy(partial).to(self.device), rows, ids

    def allreduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
        if self.shard is not None:
            dist.all_reduce(t, op=op, group=self.shard.group)
        return t

    def full_stats(
        self, x: torch.Tensor, work: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-sum-exp, entropy) of each row of x over the whole (possibly sharded) vocabulary.
        `work`, shaped and typed like x, is scratch space (overwritten; a fresh tensor if None)."""
        top = self.allreduce(x.amax(dim=-1), dist.ReduceOp.MAX)
        e = torch.sub(x, top.unsqueeze(-1), out=work) if work is not None else x - top.unsqueeze(-1)
        e.exp_()
        total = self.allreduce(e.sum(dim=-1), dist.ReduceOp.SUM)
        weighted = self.allreduce((e.mul_(x)).sum(dim=-1), dist.ReduceOp.SUM)
        lse = total.log() + top
        return lse, lse - weighted / total

    def support_lse(self, x: torch.Tensor, coords: _Coords) -> torch.Tensor:
        """Log-sum-exp over its support of each partial row of x, from the support entries (O(nnz))."""
        partial, rows, ids = coords
        vals = x[partial[rows], ids]
        top = torch.full((partial.numel(),), float("-inf"), dtype=x.dtype, device=x.device)
        top.scatter_reduce_(0, rows, vals, reduce="amax", include_self=True)
        top = self.allreduce(top, dist.ReduceOp.MAX)
        total = torch.zeros(partial.numel(), dtype=x.dtype, device=x.device).index_add_(
            0, rows, torch.exp(vals - top[rows])
        )
        return self.allreduce(total, dist.ReduceOp.SUM).log() + top

    def local_targets(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index into this rank's vocabulary slice, whether this rank owns the target)."""
        if self.shard is None:
            return targets, torch.ones_like(targets, dtype=torch.bool)
        local = targets - self.shard.start
        own = (local >= 0) & (local < self.local_vocab)
        return torch.where(own, local, torch.zeros_like(local)), own


def _pick(x: torch.Tensor, local: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    picked = x.gather(-1, local.unsqueeze(-1)).squeeze(-1)
    return torch.where(own, picked, torch.zeros_like(picked))


def _in_support(coords: _Coords, local: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """Per partial row: does this rank's part of its support contain the (owned) target?"""
    partial, rows, ids = coords
    hit = torch.zeros(partial.numel(), dtype=torch.float64, device=ids.device).index_add_(
        0, rows, (ids == local[partial][rows]).double()
    )
    return (hit > 0) & own[partial]


class ChunkStats(NamedTuple):
    logp: torch.Tensor
    entropy: torch.Tensor
    lse_full: torch.Tensor
    lse_support: torch.Tensor


def _chunk_forward(
    plan: ScoringPlan,
    x: torch.Tensor,
    targets: torch.Tensor,
    a: int,
    b: int,
    work: torch.Tensor | None = None,
) -> ChunkStats:
    """Log-probs, entropy and both log-sum-exps of rows [a, b), from x = their logits / T (`work`:
    scratch space shaped like x)."""
    lz, entropy = plan.full_stats(x, work)
    lse_full = lz
    local, own = plan.local_targets(targets[a:b])
    picked = plan.allreduce(_pick(x, local, own), dist.ReduceOp.SUM)
    coords = plan.support_coords(a, b) if plan.support is not None else None
    if coords is not None:
        partial = coords[0]
        inside = plan.allreduce(_in_support(coords, local, own).double(), dist.ReduceOp.SUM)
        if bool((inside == 0).any()):
            row = a + int(partial[(inside == 0).nonzero()[0, 0]])
            raise SupportViolation(row, _support_row(plan, row), int(targets[row]))
        lz = lz.clone()
        lz[partial] = plan.support_lse(x, coords)
    return ChunkStats(picked - lz, entropy, lse_full, lz)


def forward_chunks(
    plan: ScoringPlan, targets: torch.Tensor, scaled: Callable[[int, int], torch.Tensor]
) -> ChunkStats:
    """Every chunk's `_chunk_forward`, written into (N,) tensors; `scaled(a, b)` gives x of rows [a, b).
    One scratch tensor of a chunk's size serves every chunk (a fresh large tensor per chunk costs
    its page faults each time)."""
    out = ChunkStats(*(torch.empty(plan.n, dtype=plan.dtype, device=plan.device) for _ in range(4)))
    work: torch.Tensor | None = None
    for a, b in plan.chunks():
        x = scaled(a, b)
        if work is None or work.shape[0] < x.shape[0]:  # the same dtype and width in every chunk
            work = torch.empty_like(x)
        for whole, part in zip(out, _chunk_forward(plan, x, targets, a, b, work[: x.shape[0]])):
            whole[a:b] = part
    return out


def chunk_grad(
    plan: ScoringPlan,
    x: torch.Tensor,
    targets: torch.Tensor,
    saved: ChunkStats,
    a: int,
    b: int,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
) -> torch.Tensor:
    """The gradient w.r.t. the (untempered) logits of rows [a, b), from x = their logits / T
    (x is overwritten; the log-prob-only gradient of rows whose support is the full vocabulary is
    computed in x itself and returned)."""
    gl = None if grad_logp is None else grad_logp[a:b].to(plan.dtype)
    coords = plan.support_coords(a, b) if gl is not None and plan.support is not None else None
    if gl is not None and grad_entropy is None and coords is None:
        # dlogp/dx = onehot(target) - p, p = exp(x - lse) <= 1, computed in x itself
        g = x.sub_(saved.lse_full[a:b].unsqueeze(-1)).exp_().mul_(gl.neg().unsqueeze(-1))
        _add_at_targets(plan, g, targets[a:b], gl)
        return plan.divide_by_temperature(g)
    g = torch.zeros_like(x)
    if grad_entropy is not None:
        # dH/dx = -p * (log p + H), p the full tempered distribution
        logp_full = x - saved.lse_full[a:b].unsqueeze(-1)
        p = torch.exp(logp_full)
        g.addcmul_(p, logp_full.add_(saved.entropy[a:b].unsqueeze(-1)), value=-1.0)
        g.mul_(grad_entropy[a:b].to(plan.dtype).unsqueeze(-1))
        del p, logp_full
    if gl is not None:
        # dlogp/dx = onehot(target) - q, q the distribution renormalised over the support
        full_rows = gl
        if coords is not None:
            partial, rows, ids = coords
            q = torch.exp(x[partial[rows], ids] - saved.lse_support[a:b][partial][rows])
            g.index_put_((partial[rows], ids), -gl[partial][rows] * q, accumulate=True)
            full_rows = gl.clone()
            full_rows[partial] = 0.0  # partial rows are done; the rest use the full softmax
        q = torch.exp(x.sub_(saved.lse_full[a:b].unsqueeze(-1)))  # <= 1: no overflow on partial rows
        g.addcmul_(q, full_rows.unsqueeze(-1), value=-1.0)
        del q
        _add_at_targets(plan, g, targets[a:b], gl)
    return plan.divide_by_temperature(g)


def _add_at_targets(plan: ScoringPlan, g: torch.Tensor, targets: torch.Tensor, values: torch.Tensor) -> None:
    """g[i, targets[i]] += values[i] for the targets in this shard's part of the vocabulary."""
    local, own = plan.local_targets(targets)
    g.scatter_add_(-1, local.unsqueeze(-1), torch.where(own, values, torch.zeros_like(values)).unsqueeze(-1))


class _SupportLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits2d: torch.Tensor, targets: torch.Tensor, plan: ScoringPlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stats = forward_chunks(plan, targets, lambda a, b: plan.scaled(logits2d, a, b))
        ctx.save_for_backward(logits2d, targets, *stats[1:])
        ctx.plan = plan
        return stats.logp, stats.entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None]:
        logits2d, targets, entropy, lse_full, lse_support = ctx.saved_tensors
        plan: ScoringPlan = ctx.plan
        saved = ChunkStats(entropy, entropy, lse_full, lse_support)  # logp is not needed
        grad = torch.zeros_like(logits2d)
        for a, b in plan.chunks():
            g = chunk_grad(plan, plan.scaled(logits2d, a, b), targets, saved, a, b, grad_logp, grad_entropy)
            plan.write_rows(grad, g.to(grad.dtype), a, b)
        return grad, None, None


def _support_row(plan: ScoringPlan, row: int) -> int:
    return row if plan.support_rows is None else int(plan.support_rows[row])


def make_plan(
    rows2d: torch.Tensor,
    target_ids: torch.Tensor,
    support: RolloutSamplingMask | None,
    temperature: float,
    *,
    local_vocab: int,
    dtype: torch.dtype,
    positions: torch.Tensor | None = None,
    support_rows: np.ndarray | torch.Tensor | None = None,
    vocab_shard: VocabShard | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> tuple[ScoringPlan, torch.Tensor]:
    """The validated plan (and the flat long target ids) of scoring the rows of `rows2d` (logits,
    or the hidden states the logits are made from) whose vocabulary slice has `local_vocab` ids."""
    if not temperature > 0:  # 0 (greedy) is a point mass: nothing to score or differentiate
        raise ValueError(f"sampling.temperature must be > 0 to score log-probs, got {temperature}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    targets = target_ids.reshape(-1).long()
    if positions is not None:
        positions = positions.reshape(-1).long()
        if positions.numel() and (positions.min() < 0 or positions.max() >= rows2d.shape[0]):
            raise ValueError(f"positions must lie in [0, {rows2d.shape[0]})")
    n = rows2d.shape[0] if positions is None else positions.numel()
    if targets.numel() != n:
        raise ValueError(f"{targets.numel()} target ids for {n} scored rows")
    full_vocab = local_vocab if vocab_shard is None else vocab_shard.vocab_size
    if n and (targets.min() < 0 or targets.max() >= full_vocab):
        bad = targets[(targets < 0) | (targets >= full_vocab)][0]
        raise ValueError(f"target id {int(bad)} outside the vocabulary [0, {full_vocab})")
    rows_idx = None
    if support is not None:
        if support.vocab_size != full_vocab:
            raise ValueError(f"support vocab_size {support.vocab_size} != logits vocabulary {full_vocab}")
        if support_rows is not None:
            rows_idx = np.asarray(
                support_rows.cpu() if isinstance(support_rows, torch.Tensor) else support_rows, dtype=np.int64
            ).reshape(-1)
            if rows_idx.size != n:
                raise ValueError(f"{rows_idx.size} support_rows for {n} scored rows")
            support = support.select(rows_idx) if n else support
        elif support.num_rows != n:
            raise ValueError(f"support has {support.num_rows} rows for {n} scored rows")
    plan = ScoringPlan(
        n=n,
        temperature=float(temperature),
        chunk_rows=chunk_rows,
        dtype=dtype,
        positions=positions,
        support=support,
        shard=vocab_shard,
        local_vocab=local_vocab,
        support_rows=rows_idx,
        unique_positions=positions is None or int(torch.unique(positions).numel()) == n,
        device=rows2d.device,
    )
    return plan, targets


def log_probs_with_support(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    support: RolloutSamplingMask | None = None,
    temperature: float = 1.0,
    *,
    positions: torch.Tensor | None = None,
    support_rows: np.ndarray | torch.Tensor | None = None,
    vocab_shard: VocabShard | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> LogProbs:
    """Log-prob of each target under softmax(logits / temperature) renormalised over its support,
    and the entropy of the full tempered distribution. Differentiable w.r.t. `logits`.

    logits: (..., V) — flattened to rows; `positions` (N,) optionally picks the scored rows (no copy
    of the logits is made). target_ids: (N,) ids of the scored rows. support: None (the full
    vocabulary; no mask is built) or a mask whose row `support_rows[i]` (default i) is row i's
    support. Raises `SupportViolation` (a ValueError) naming the row when a target is outside.
    """
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape (..., vocab), got {tuple(logits.shape)}")
    logits2d = logits.reshape(-1, logits.shape[-1])
    dtype = torch.promote_types(logits.dtype, torch.float32)
    plan, targets = make_plan(
        logits2d,
        target_ids,
        support,
        temperature,
        local_vocab=logits2d.shape[-1],
        dtype=dtype,
        positions=positions,
        support_rows=support_rows,
        vocab_shard=vocab_shard,
        chunk_rows=chunk_rows,
    )
    if plan.n == 0:
        empty = logits2d.new_zeros(0, dtype=dtype)
        return LogProbs(empty, empty.clone())
    logp, entropy = _SupportLogProbs.apply(logits2d, targets, plan)  # type: ignore[no-untyped-call]  # torch leaves Function.apply unannotated
    return LogProbs(logp, entropy)
