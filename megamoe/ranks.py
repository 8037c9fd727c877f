"""What the fused layer needs from its process group (SPEC §6): the symmetric workspace, one
agreement per call before the launch, and a barrier.

    host = host_group(group)                               # gloo: host collectives, also while capturing
    ws, offsets = symmetric_zeros(nbytes, device, group)   # offsets[r]: byte offset to rank r's copy
    agree(host, err, options)                              # every rank raises unless all may launch

One rank (group None) needs none of it: a plain allocation, no collective. Several ranks share one
buffer per rank made by `torch.distributed._symmetric_memory.empty` and `rendezvous`; a pointer
into this rank's buffer maps to rank r's copy by adding offsets[r] (the kernel's `peer_ptr`).
Several ranks may share one GPU for tests (a gloo group and TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1,
which `megamoe.multirank.spawn` sets); the code does not assume a rank count.
"""

from __future__ import annotations

import struct

import torch

from megamoe.reference.errors import MegaMoEInputError, fail


def rank_and_size(group) -> tuple[int, int]:
    """(this process's rank in the group, the group's size); (0, 1) for group None."""
    if group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def host_group(group):
    """A gloo group of the same ranks, for the per-call agreement and barriers: host tensors, no
    device synchronisation, usable while a CUDA graph is being captured. The group itself when it
    is gloo; else a new one (collective: every rank of the group calls it). None for one rank."""
    if rank_and_size(group)[1] == 1:
        return None
    import torch.distributed as dist

    if dist.get_backend(group) == "gloo":
        return group
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo")


def barrier(host) -> None:
    """Every rank's host reaches this point (the GPU work queued before it is not waited for)."""
    if host is not None:
        import torch.distributed as dist

        dist.barrier(group=host)


def enable_symm_mem(symm_mem, group_name: str) -> None:
    """torch's enable_symm_mem_for_group, where it is still needed: before a rendezvous up to torch
    2.8; later versions mark it deprecated ("There is no need to call this function anymore", with a
    FutureWarning at every call) and are not called."""
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None and getattr(enable, "__deprecated__", None) is None:
        enable(group_name)


def symmetric_zeros(nbytes: int, device: torch.device, group, host=None) -> tuple[torch.Tensor, list[int]]:
    """A zeroed uint8 buffer of nbytes on device, the same size on every rank, and the byte offset
    from it to each rank's copy. Collective: every rank of the group calls it with the same nbytes
    (host: the group's host_group). On return every rank's buffer is zero (a peer's first call
    cannot be wiped by a late zeroing)."""
    rank, size = rank_and_size(group)
    if size == 1:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device), [0]
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    enable_symm_mem(symm_mem, group.group_name)
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buf, group)
    # buffer_ptrs name each rank's allocation; from a memory pool that is the segment, and the
    # buffer may sit at another offset in it on each rank: exchange those offsets too.
    inside = torch.tensor([buf.data_ptr() - int(handle.buffer_ptrs[rank])], dtype=torch.int64)
    everyone = [torch.zeros_like(inside) for _ in range(size)]
    host = host if host is not None else host_group(group)
    dist.all_gather(everyone, inside, group=host)
    buf.zero_()
    torch.cuda.synchronize(device)
    barrier(host)
    mine = buf.data_ptr()
    return buf, [int(p) + int(o.item()) - mine for p, o in zip(handle.buffer_ptrs, everyone)]


def same_on_every_rank(host, arg: str, what: str, value) -> None:
    """Collective: raise MegaMoEInputError on every rank unless every rank passed the same value
    (anything all_gather_object can carry)."""
    if host is None:
        return
    import torch.distributed as dist

    values: list = [None] * dist.get_world_size(host)
    dist.all_gather_object(values, value, group=host)
    for r, v in enumerate(values):
        if v != values[0]:
            fail(arg, f"the same {what} on every rank (rank 0: {values[0]})", f"rank {r}: {v}")


def from_rank0(host, value):
    """Collective: rank 0's `value` on every rank (`value` itself for one rank), e.g. the id of a
    call that every rank records in its dump."""
    if host is None:
        return value
    import torch.distributed as dist

    values: list = [None] * dist.get_world_size(host)
    dist.all_gather_object(values, value, group=host)
    return values[0]


def call_options(**options) -> tuple[int, ...]:
    """A call's options as int64 words, for `agree` (None and floats by their float64 bits)."""
    words = []
    for v in options.values():
        if v is None:
            words.append(-(2**63))
        elif isinstance(v, float):
            words.append(struct.unpack("<q", struct.pack("<d", v))[0])
        else:
            words.append(int(v))
    return tuple(words)


def agree(host, err: BaseException | None, options: tuple[int, ...] = (), names: tuple[str, ...] = ()) -> None:
    """Collective, once per call before the launch, on the host group: raise on every rank unless
    every rank may launch, so that no rank waits in the kernel for a peer that never comes. A rank
    may not launch when it refused (err: its bad input, SPEC §7, or anything else that failed
    before the launch), or when the ranks' options differ (every rank must run the same kernel).
    The refusing rank raises its own error; the others raise one that names it and quotes it:
    MegaMoEInputError for bad input, RuntimeError for anything else."""
    if host is None:
        if err is not None:
            raise err
        return
    import torch.distributed as dist

    size = dist.get_world_size(host)
    mine = torch.tensor([0 if err is None else 2 if isinstance(err, MegaMoEInputError) else 1, *options])
    rows = [torch.zeros_like(mine) for _ in range(size)]
    dist.all_gather(rows, mine, group=host)
    if any(int(r[0]) for r in rows):
        messages: list[str | None] = [None] * size
        quoted = (
            None if err is None else str(err) if isinstance(err, MegaMoEInputError) else f"{type(err).__name__}: {err}"
        )
        dist.all_gather_object(messages, quoted, group=host)
        if err is not None:
            raise err
        first = next(r for r, row in enumerate(rows) if int(row[0]))
        kind = MegaMoEInputError if int(rows[first][0]) == 2 else RuntimeError
        raise kind(f"rank {first} refused its call, so no rank launches: {messages[first]}")
    for r, row in enumerate(rows):
        if not torch.equal(row, rows[0]):
            differ = [n for n, a, b in zip(names, row[1:].tolist(), rows[0][1:].tolist()) if a != b]
            raise MegaMoEInputError(
                f"argument {', '.join(differ) or 'options'}: expected the same on every rank (rank 0 and rank {r} "
                "differ), got different calls; no rank launches"
            )
