"""GPU checks of weight transfers out of GPU memory, run by tests/gpu/test_gpu_smoke.py (and on their
own: `python tests/gpu/gpu_transfer_checks.py`, exit 1 on failure):

1. a VRAM NIXL transfer: a bucket in GPU memory registered with a publisher-side NIXL endpoint (as
   VRAM, device = its CUDA index), read by a receiver's endpoint into a GPU buffer (one range and
   several pieces) and into a host buffer; the bytes equal the bucket's. Needs `nixl` (and what
   furlong.transfer.nixl_transport imports): where it is not importable the check is skipped with
   the reason printed. With FURLONG_GPU_DEVICE=cpu the same transfer runs between host buffers.
2. an engine's receive into a GPU buffer: the rollout service's receivers with
   `--weight-buffer-device` set to the device (`furlong.rollout.receivers.receiver_transfer`:
   `TransferConfig(device=...)`) take a version, in several rounds, into a receive buffer on that
   device (`furlong.transfer.destination.BufferDestination`), over NIXL from a host bucket and from
   a bucket on the device; every round verifies against its checksum (hashed from a host copy of
   the GPU buffer) and the engine's parameters on the device load the received views with no copy
   through host memory. Needs `nixl` (skipped otherwise, as 1.); with FURLONG_GPU_DEVICE=cpu the
   buffer is host memory, as with the default `cpu`.
3. a CUDA-IPC update: the bucket is exported as a CUDA IPC share (furlong.transfer.cuda_ipc); a
   child process on the same GPU opens it and copies a range into its own GPU memory, twice, the
   publisher rewriting the bucket in between; each copy equals the bucket's bytes at that time.
   Needs CUDA (skipped on the CPU) and only torch plus libs/core and libs/transfer.

Check 2 also imports furlong.rpc and furlong.v1 (libs/proto, with grpc and protobuf; skipped where
they are not importable).
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _source in ("libs/core", "libs/transfer", "libs/proto"):
    if str(ROOT / _source) not in sys.path:  # the GPU machine has the tree, not installed packages
        sys.path.insert(0, str(ROOT / _source))

import torch  # noqa: E402

SIZE_BYTES = (8 << 20) + 4096  # not a multiple of any page size
CHILD_TIMEOUT_S = 120.0


class Skipped(Exception):
    """The check cannot run here; the message says why."""


def _random_bytes(size: int, seed: int, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).to(device)


def check_nixl_vram(device: str) -> str:
    try:
        from furlong.core.weight_versions import WeightSourceInfo
        from furlong.transfer.device_memory import memory_of, settle
        from furlong.transfer.nixl_transport import NixlEndpoint
    except ImportError as exc:
        raise Skipped(f"NIXL transfer: {exc.name or exc} is not importable here") from None
    import numpy as np

    bucket = _random_bytes(SIZE_BYTES, 1, device)
    settle(bucket)
    publisher, receiver = NixlEndpoint("gpu-check-publisher"), NixlEndpoint("gpu-check-receiver")
    try:
        publisher.register(bucket)
        kind, device_id = memory_of(bucket)
        assert kind == ("VRAM" if bucket.device.type == "cuda" else "DRAM"), kind
        source = WeightSourceInfo(
            publisher.agent_name,
            publisher.metadata,
            bucket.data_ptr(),
            SIZE_BYTES,
            memory_kind=kind,
            device_id=device_id,
        )
        on_device = torch.zeros(SIZE_BYTES, dtype=torch.uint8, device=device)
        on_host = torch.zeros(SIZE_BYTES, dtype=torch.uint8)
        receiver.register([on_device, on_host])

        offset, size = 4096 + 17, SIZE_BYTES - 8192
        seconds = receiver.read(source, on_device, size, 60.0, src_offset_bytes=offset)
        assert torch.equal(on_device[:size], bucket[offset : offset + size]), "VRAM -> device buffer differs"

        # (offset in the bucket, bytes, offset in the buffer): disjoint destinations
        pieces = [(0, 1 << 20, 5), ((3 << 20) + 1, 1 << 16, 2 << 20), (SIZE_BYTES - 4096, 4096, 4 << 20)]
        local = np.array([[on_device.data_ptr() + at, n, 0] for _, n, at in pieces], dtype=np.uint64)
        remote = np.array([[bucket.data_ptr() + o, n, device_id] for o, n, _ in pieces], dtype=np.uint64)
        on_device.zero_()
        receiver.read_descs(source, local, remote, 60.0)
        for src_offset, n, at in pieces:
            assert torch.equal(on_device[at : at + n], bucket[src_offset : src_offset + n]), (src_offset, n)

        receiver.read(source, on_host, SIZE_BYTES, 60.0)
        assert torch.equal(on_host, bucket.cpu()), f"{kind} -> host buffer differs"
    finally:
        receiver.close()
        publisher.close()
    gbps = size / seconds / 1e9
    return (
        f"{kind} bucket on {bucket.device} (NIXL device {device_id}) read into {on_device.device} "
        f"({size} bytes, {gbps:.2f} GB/s incl. setup), in 3 pieces, and into host memory: bytes equal"
    )


def _receive_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        "embed.weight": torch.randn(2048, 512, generator=generator),  # 4 MiB: a round of its own
        "layer.proj.weight": torch.randn(1024, 768, generator=generator).to(torch.bfloat16),
        "layer.norm.weight": torch.randn(513, generator=generator),
        "lm_head.weight": torch.randn(1000, 512, generator=generator).to(torch.bfloat16),
    }


def check_receive_into_device_buffer(device: str) -> str:
    try:
        from furlong.core.weight_versions import WeightSourceInfo
        from furlong.core.weights import (
            Manifest,
            WeightLayout,
            combine_checksums,
            plan_buckets,
            round_checksums,
            stage_round,
        )
        from furlong.transfer.config import TransferConfig
        from furlong.transfer.destination import BufferDestination
        from furlong.transfer.device_memory import memory_of, settle
        from furlong.transfer.lanes import connect_lane
        from furlong.transfer.nixl_transport import NixlEndpoint
    except ImportError as exc:
        raise Skipped(f"receive into a {device} buffer: {exc.name or exc} is not importable here") from None

    state = _receive_state()
    layout = WeightLayout.from_state_dict(state)
    plan = plan_buckets(layout, 2 << 20)
    plan = plan.with_checksums(round_checksums(layout, plan, state))
    manifest = Manifest(1, layout, combine_checksums([r.checksum for r in plan.rounds]), plan)
    receive_device = TransferConfig(device=device).device  # what --weight-buffer-device sets
    done = []
    for bucket_device in dict.fromkeys(("cpu", device)):  # the trainer's bucket: host, then the GPU
        bucket = torch.zeros(plan.bucket_size_bytes, dtype=torch.uint8, device=bucket_device)
        publisher, receiver = NixlEndpoint("gpu-check-trainer"), NixlEndpoint("gpu-check-engine")
        lane = None
        try:
            publisher.register(bucket)
            kind, device_id = memory_of(bucket)
            source = WeightSourceInfo(
                publisher.agent_name,
                publisher.metadata,
                bucket.data_ptr(),
                bucket.numel(),
                memory_kind=kind,
                device_id=device_id,
            )
            received = BufferDestination(layout, receiver, receive_device)
            assert received.buffer.device.type == torch.device(device).type, received.buffer.device
            lane = connect_lane(source, ("nixl",), receiver, 1 << 20)
            for rnd in manifest.rounds:
                stage_round(layout, rnd, state, bucket)
                settle(bucket)
                _, digest = received.pull(lane, rnd, source.holds_all_rounds, 60.0)
                digest = digest or received.digest(rnd)
                assert digest == rnd.checksum, f"round {rnd.index}: {digest} != {rnd.checksum}"
            views = received.tensors(manifest)
            params = {name: torch.zeros_like(t, device=device) for name, t in state.items()}
            for name, param in params.items():
                assert views[name].device == received.buffer.device, (name, views[name].device)
                param.copy_(views[name])  # the engine's load (Engine.load_weights): on the device
            settle(next(iter(params.values())))
            for name, tensor in state.items():
                assert torch.equal(params[name].cpu(), tensor), f"{name} differs after the load"
        finally:
            if lane is not None:
                lane.close()
            receiver.close()
            publisher.close()
        done.append(f"{kind} bucket on {bucket.device}")
    return (
        f"{len(manifest.rounds)} rounds ({layout.total_bytes} bytes) into a receive buffer on "
        f"{received.buffer.device} from a {' and a '.join(done)} over NIXL: every round's checksum "
        f"holds and parameters on {device} loaded the views"
    )


def _child(share_json: str) -> int:
    """The engine side of the CUDA-IPC check: open the share, then for every `read OFFSET SIZE PATH`
    line on stdin copy the range into a GPU buffer of this process and write its bytes to PATH."""
    from furlong.core.cuda_ipc_share import CudaIpcShare
    from furlong.transfer.cuda_ipc import open_share

    fields = json.loads(share_json)
    for name in ("handle", "ref_counter_handle", "event_handle"):
        fields[name] = bytes.fromhex(fields[name])
    size_bytes = fields.pop("size_bytes")
    bucket = open_share(CudaIpcShare(**fields), size_bytes, "gpu-check-publisher")
    print(f"opened {bucket.device}", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        _, offset, size, path = line.split()
        dst = torch.empty(int(size), dtype=torch.uint8, device=bucket.device)
        dst.copy_(bucket[int(offset) : int(offset) + int(size)])
        torch.cuda.synchronize(dst.device)
        Path(path).write_bytes(dst.cpu().numpy().tobytes())
        print("done", flush=True)
    return 0


def _reply(child: subprocess.Popen[str], deadline: float) -> str:
    assert child.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([child.stdout], [], [], 0.5)
        if ready:
            line = child.stdout.readline()
            if not line:
                break
            return line.strip()
        if child.poll() is not None:
            break
    stderr = child.stderr.read() if child.stderr is not None and child.poll() is not None else ""
    raise AssertionError(f"the child process did not answer (exit {child.poll()}): {stderr[-2000:]}")


def check_cuda_ipc_update(device: str) -> str:
    if not device.startswith("cuda"):
        raise Skipped(f"CUDA IPC needs a CUDA device, got {device!r}")
    from furlong.transfer.cuda_ipc import export_share
    from furlong.transfer.device_memory import settle

    bucket = torch.zeros(SIZE_BYTES, dtype=torch.uint8, device=device)
    share = export_share(bucket)
    fields = dataclasses.asdict(share)
    for name in ("handle", "ref_counter_handle", "event_handle"):
        fields[name] = fields[name].hex()
    fields["size_bytes"] = SIZE_BYTES
    child = subprocess.Popen(  # the same environment: it sees the same GPUs
        [sys.executable, __file__, "--open-share", json.dumps(fields)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        opened = _reply(child, deadline)
        assert opened.startswith("opened cuda"), opened
        with tempfile.TemporaryDirectory() as scratch:
            offset, size = 12345, SIZE_BYTES - 2 * 12345
            for version in (1, 2):  # the publisher rewrites the bucket between two updates
                bucket.copy_(_random_bytes(SIZE_BYTES, 10 + version, device))
                settle(bucket)
                path = Path(scratch) / f"v{version}.bin"
                child.stdin.write(f"read {offset} {size} {path}\n")
                child.stdin.flush()
                assert _reply(child, deadline) == "done"
                got = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
                assert torch.equal(got, bucket[offset : offset + size].cpu()), f"version {version} differs"
        child.stdin.write("quit\n")
        child.stdin.flush()
        assert child.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return (
        f"a child process opened the share of a {SIZE_BYTES}-byte bucket on {bucket.device} "
        f"(GPU {share.device_uuid}) and copied {size} bytes of two versions: both equal the bucket's"
    )


CHECKS = [
    ("VRAM NIXL transfer", check_nixl_vram),
    ("engine receive into a device buffer", check_receive_into_device_buffer),
    ("CUDA-IPC update", check_cuda_ipc_update),
]


def main() -> int:
    device = os.environ.get("FURLONG_GPU_DEVICE", "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"SKIPPED: {device} is not available on this machine")
        return 0
    failed = 0
    for label, check in CHECKS:
        started = time.perf_counter()
        try:
            detail = check(device)
        except Skipped as exc:
            print(f"skip {label}: {exc}")
        except Exception as exc:  # noqa: BLE001 - report every check, then fail
            failed += 1
            print(f"FAIL {label}: {type(exc).__name__}: {exc}")
        else:
            print(f"ok   {label} ({time.perf_counter() - started:.1f} s): {detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--open-share":
        sys.exit(_child(sys.argv[2]))
    sys.exit(main())
