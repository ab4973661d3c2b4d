"""Host buffers for transfers: anonymous memory advised for transparent huge pages.

NIXL's UCX transport between processes of one host is CMA (process_vm_readv), which pins and walks
the pages of both sides; with 2 MiB pages instead of 4 KiB ones a READ runs about twice as fast on
the development machine (2.6 -> 4.5-5.8 GB/s for 256 MiB). Transparent huge pages are usually in
`madvise` mode, so memory must ask for them: `host_buffer` maps anonymous memory, aligns it to
2 MiB and advises MADV_HUGEPAGE. Where the kernel does not support it, the buffer is still valid
and the fallback is logged once. Tensors torch allocates (an engine's parameters) get the same
with the environment variable THP_MEM_ALLOC_ENABLE=1 in the process (read by torch itself).

POSIX shared memory (/dev/shm) gets huge pages only where the kernel's shmem_enabled allows it;
the shared-memory bucket is therefore a plain mapping. Knows nothing about what the buffer holds.
"""

from __future__ import annotations

import logging
import mmap

import torch

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_warned = False


def host_buffer(size_bytes: int) -> torch.Tensor:
    """A zero-filled, contiguous 1-D uint8 host tensor of size_bytes, starting on a 2 MiB boundary
    and advised for transparent huge pages. It keeps its mapping alive; pages are faulted in on
    first touch."""
    global _warned
    if size_bytes < 1:
        raise ValueError(f"host buffer size_bytes {size_bytes} < 1")
    # Private: an anonymous shared mapping is shmem, which gets no transparent huge pages.
    mapping = mmap.mmap(-1, size_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError) as exc:
        if not _warned:
            _warned = True
            log.warning(
                "transparent huge pages not available for transfer buffers (%s); using 4 KiB pages", exc
            )
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[skip : skip + size_bytes]
