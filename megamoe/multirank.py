"""Run a function on R ranks, one process each, for tests and the command line (SPEC §6).

    results = spawn(fn, ranks=2, args=(cfg, seed))   # [fn(0, 2, cfg, seed), fn(1, 2, cfg, seed)]

Each process joins a gloo process group (a file rendezvous in a fresh folder, so parallel test
workers never meet), is placed on GPU `rank % device_count` when there is one (all ranks on one GPU
when it is the only one: TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 lets them share symmetric
memory; NVLink multicast is kept off), and calls fn(rank, ranks, *args) with the group as
`megamoe.multirank.group()`. fn must be importable by name (a module-level function) and return
what torch.save can write (CPU tensors, Dump objects, plain Python values).

A rank that raises, dies (a signal, os._exit, a CUDA error that kills the process) or outlives the
timeout ends the run: the other ranks are killed (they would wait on it forever) and `RankFailed`
says which rank, how, and the rank's traceback.
"""

from __future__ import annotations

import io
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable

# Kept off on every machine (SPEC §6): NVLink multicast objects are not part of this design.
ENV = {
    "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
}

_GROUP = None


class RankFailed(RuntimeError):
    """One rank of a spawned run raised, died or timed out (the message says which and how)."""

    def __init__(self, rank: int | None, message: str):
        super().__init__(message)
        self.rank = rank


def group():
    """The process group of the rank this process runs (inside a function given to spawn)."""
    if _GROUP is None:
        raise RuntimeError("megamoe.multirank.group(): not inside a rank started by megamoe.multirank.spawn")
    return _GROUP


def _rank_main(fn: Callable, rank: int, ranks: int, args: tuple, init: str, results) -> None:
    global _GROUP
    os.environ.update(ENV)
    try:
        import torch
        import torch.distributed as dist

        if torch.cuda.is_available():
            # No symm_mem.set_backend: torch 2.11 registers its CUDA allocator (the one that works
            # with gloo groups and ranks sharing a GPU) as the default without offering it by name;
            # set_backend("CUDA") raises "does not find allocation backend CUDA" (seen on the H200).
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks)
        _GROUP = dist.group.WORLD
        try:
            out = fn(rank, ranks, *args)
        finally:
            _GROUP = None
        # torch.save bytes, not the object: a pickled tensor would travel as a file descriptor of
        # shared memory, which the parent can only open while this process lives.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
        # No destroy_process_group barrier: a peer that failed would keep this rank waiting.
    except BaseException as e:  # reported in words to the parent, which raises RankFailed
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def spawn(fn: Callable, ranks: int, args: tuple = (), *, timeout: float = 900.0, poll: float = 0.05) -> list:
    """fn(rank, ranks, *args) on `ranks` processes; its return values in rank order (see the module
    docstring). Raises RankFailed naming the first rank that raised, died or timed out."""
    if ranks < 1:
        raise ValueError(f"spawn: ranks must be at least 1, got {ranks}")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")  # CUDA cannot be forked; every rank starts clean
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="megamoe-ranks-") as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, ranks, args, init, results), name=f"megamoe-rank-{r}")
            for r in range(ranks)
        ]
        # The ranks' environment from their first instruction on (torch reads some of it at import,
        # which unpickling fn's module may do before _rank_main runs); this process's is restored.
        saved = {k: os.environ.get(k) for k in ENV}
        os.environ.update(ENV)
        try:
            for p in procs:
                p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        try:
            return _collect(procs, results, ranks, timeout, poll)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=30)


def _collect(procs, results, ranks: int, timeout: float, poll: float) -> list:
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while len(out) < ranks:
        try:
            rank, ok, value = results.get(timeout=poll)
        except queue.Empty:
            if any(r not in out and p.exitcode is not None for r, p in enumerate(procs)):
                _fail(procs, results, out, {})
            if time.monotonic() > deadline:
                late = [r for r in range(ranks) if r not in out]
                raise RankFailed(late[0], f"ranks {late} did not finish within {timeout:.0f} s") from None
            continue
        if not ok:
            _fail(procs, results, out, {rank: value})
        out[rank] = value
    return [_loaded(out[r]) for r in range(ranks)]


def _loaded(data: bytes):
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)  # written by this module's own ranks


def _fail(procs, results, out: dict, failed: dict[int, str], grace: float = 3.0) -> None:
    """Raise RankFailed for a run with a failed or dead rank. The first report is often a peer's
    collective that lost its connection to the rank that really failed: wait a moment for every
    rank's report or exit, then name a rank that died without a report first, then the others."""
    end = time.monotonic() + grace
    while time.monotonic() < end and any(r not in out and r not in failed for r in range(len(procs))):
        try:
            rank, ok, value = results.get(timeout=0.05)
        except queue.Empty:
            if all(p.exitcode is not None for r, p in enumerate(procs) if r not in out and r not in failed):
                break
            continue
        if ok:
            out[rank] = value
        else:
            failed[rank] = value
    dead = [r for r, p in enumerate(procs) if r not in out and r not in failed and p.exitcode is not None]
    lines = [f"rank {r} died without a report ({_how(procs[r].exitcode)})" for r in dead]
    # Reports in arrival order, a lost connection (a peer's collective) after the others.
    order = sorted(failed, key=lambda r: any(m in failed[r] for m in _LOST_PEER))
    lines += [f"rank {r} failed: {failed[r]}" for r in order]
    raise RankFailed((dead + order)[0], "\n".join(lines))


# How gloo's collectives fail when a peer process went away.
_LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _how(exitcode: int) -> str:
    if exitcode < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
