"""Which SGLang route carries a policy version to a pool's engines (a pure decision, applied by the
engine pool):

- `tensor`: `/update_weights_from_tensor`, the tensors shared as CUDA IPC handles (shared-memory
  files for CPU tensors): no copy through disk or the network, but the servers must run on this
  host. Chosen for SGLang engines the pool launched when the engines' device is a GPU.
- `distributed`: `/update_weights_from_distributed`, broadcast from this process as rank 0 of a
  torch.distributed group (`WeightUpdateGroup`; NCCL for CUDA tensors, gloo for CPU ones): for
  servers on other hosts. Chosen for attached SGLang servers (`engine_urls`) on a GPU.
- `disk`: `/update_weights_from_disk`, a checkpoint directory the servers read. The CPU fallback,
  and always Furlong's own engine servers' route.

`WEIGHT_ROUTE_AUTO` makes that choice; an explicit route overrides it (e.g. `tensor` on CPU, which
the stand-in servers of the tests accept). The tensor and distributed routes have not been run on a
GPU in this repository's tests.
"""

from __future__ import annotations

from furlong.core.settings.rollout import ENGINE_SGLANG

WEIGHT_ROUTE_AUTO = "auto"
WEIGHT_ROUTE_DISK = "disk"
WEIGHT_ROUTE_TENSOR = "tensor"
WEIGHT_ROUTE_DISTRIBUTED = "distributed"
WEIGHT_ROUTES = (WEIGHT_ROUTE_AUTO, WEIGHT_ROUTE_DISK, WEIGHT_ROUTE_TENSOR, WEIGHT_ROUTE_DISTRIBUTED)


def choose_weight_route(requested: str, engine: str, attached: bool, device: str) -> str:
    """The route for a pool of `engine` servers (attached or launched) whose models run on
    `device`; `requested` is a route or WEIGHT_ROUTE_AUTO. ValueError for an unknown route, or
    `tensor` for attached servers (they may be on other hosts)."""
    if requested not in WEIGHT_ROUTES:
        raise ValueError(f"weight route must be one of {list(WEIGHT_ROUTES)}, got {requested!r}")
    if requested == WEIGHT_ROUTE_TENSOR and attached:
        raise ValueError("weight route 'tensor' shares memory with servers on this host, not attached ones")
    if requested != WEIGHT_ROUTE_AUTO:
        return requested
    if engine != ENGINE_SGLANG or not device.startswith("cuda"):
        return WEIGHT_ROUTE_DISK
    return WEIGHT_ROUTE_DISTRIBUTED if attached else WEIGHT_ROUTE_TENSOR


def group_backend(device: str) -> str:
    """The torch.distributed backend that carries tensors on `device`."""
    return "nccl" if device.startswith("cuda") else "gloo"
