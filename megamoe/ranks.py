"""What the fused layer needs from its process group (SPEC §6): the symmetric workspace, the per-call
agreement on bad input, and a barrier.

    ws, offsets = symmetric_zeros(nbytes, device, group)   # offsets[r]: byte offset to rank r's copy
    agree_on_inputs(group, err)                            # every rank raises if any rank refused

One rank (group None) needs none of it: a plain allocation, no collective. Several ranks share one
buffer per rank made by `torch.distributed._symmetric_memory.empty` and `rendezvous`; a pointer
into this rank's buffer maps to rank r's copy by adding offsets[r] (the kernel's `peer_ptr`).
Several ranks may share one GPU for tests (a gloo group and TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1,
which `megamoe.multirank.spawn` sets); the code does not assume a rank count.
"""

from __future__ import annotations

import torch

from megamoe.reference.errors import MegaMoEInputError


def rank_and_size(group) -> tuple[int, int]:
    """(this process's rank in the group, the group's size); (0, 1) for group None."""
    if group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def barrier(group) -> None:
    """Every rank's host reaches this point (the GPU work queued before it is not waited for)."""
    if group is not None and rank_and_size(group)[1] > 1:
        import torch.distributed as dist

        dist.barrier(group=group)


def symmetric_zeros(nbytes: int, device: torch.device, group) -> tuple[torch.Tensor, list[int]]:
    """A zeroed uint8 buffer of nbytes on device, the same size on every rank, and the byte offset
    from it to each rank's copy. Collective: every rank of the group calls it with the same nbytes.
    On return every rank's buffer is zero (a peer's first call cannot be wiped by a late zeroing)."""
    rank, size = rank_and_size(group)
    if size == 1:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device), [0]
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before rendezvous up to torch 2.8
        symm_mem.enable_symm_mem_for_group(group.group_name)
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buf, group)
    buf.zero_()
    torch.cuda.synchronize(device)
    barrier(group)
    base = handle.buffer_ptrs[rank]
    return buf, [int(p) - int(base) for p in handle.buffer_ptrs]


def agree_on_inputs(group, err: MegaMoEInputError | None) -> None:
    """Collective, once per call before the launch: raise on every rank if any rank refused its
    input, so that no rank launches a kernel whose peers never come (SPEC §7 on several ranks).
    The refusing rank raises its own error; the others raise one that names it and quotes it."""
    rank, size = rank_and_size(group)
    if size == 1:
        if err is not None:
            raise err
        return
    import torch.distributed as dist

    # gloo reduces host tensors; a device backend (NCCL) reduces on the GPU (then one sync).
    on_host = dist.get_backend(group) == "gloo"
    flag = torch.tensor([0 if err is None else 1], dtype=torch.int32)
    if not on_host:
        flag = flag.cuda()
    dist.all_reduce(flag, group=group)
    if int(flag.item()) == 0:
        return
    messages: list[str | None] = [None] * size
    dist.all_gather_object(messages, None if err is None else str(err), group=group)
    if err is not None:
        raise err
    first = next(r for r, m in enumerate(messages) if m is not None)
    raise MegaMoEInputError(f"rank {first} refused its input, so no rank launches: {messages[first]}")
