"""Hangs become errors: one table of every wait of the fused kernel made to time out
(`MegaMoE.withhold`, SPEC §5), on one rank and on two ranks as processes (`megamoe.multirank.spawn`).

    python -m bench.hangs            # every site, each in its own process, all at once

Each row: the wait withheld, R, which rank it was withheld on, the seconds from the call to the
error on the rank that reported it, and the error's last words (the trap's record: rank, SM block,
the wait, its index, expected and observed). A trap ends its process's CUDA context, so every site
runs in a new process (and spawn's ranks in theirs); the sites run side by side, since a spin-wait's
timeout counts clock cycles, which run on whatever else the GPU does.
tests/gpu/test_hangs.py asserts the records; the table is for the times (bench/NOTES.md v23)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from megamoe.jit import contract as C

# (wait, ranks, the rank it is withheld on, engine)
SITES = [
    ("dispatch", 1, 0, "swapab"),
    ("arrival", 1, 0, "swapab"),
    ("l1_done", 1, 0, "swapab"),
    ("l2_done", 1, 0, "swapab"),
    ("decoded", 1, 0, "prefill"),
    ("dispatch", 2, 1, "swapab"),
    ("arrival", 2, 0, "swapab"),
    ("l2_done", 2, 1, "swapab"),
    ("epoch", 2, 1, "swapab"),
]
# A small layer (both engines, both promotions), T tokens on every rank: T K above
# contract.LOCAL_DISPATCH_ENTRIES (160 tokens, T K = 320), so that one rank's call too waits on its
# dispatch counter.
TOKENS = C.LOCAL_DISPATCH_ENTRIES // 2 + 32
SHAPE = dict(hidden=256, intermediate=128, num_experts=4, top_k=2, max_tokens_per_rank=TOKENS)
assert TOKENS * SHAPE["top_k"] > C.LOCAL_DISPATCH_ENTRIES


def layer_and_inputs(ranks: int, rank: int, engine: str, group=None):
    from megamoe import reference as ref
    from megamoe.moe import MegaMoE

    cfg = ref.MoEConfig(**SHAPE, num_ranks=ranks)
    weights = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=1, device="cuda")
    layer = MegaMoE(cfg, weights, group=group, engine=engine)
    inp = ref.make_inputs(cfg, TOKENS, seed=1, device="cuda")[rank]
    return layer, inp


# A site's process (and each of its ranks' processes) writes every thread's Python stack to its
# stderr once it has run this long, so that a site which run_site kills at its bound shows where it
# stood (v39-v40: a different site each run printed nothing in 90 s, its stacks unknown).
STACKS_AFTER = 75.0


def _progress(rank: int, what: str) -> None:
    print(f"[site rank {rank}] {what}", flush=True)


def withheld_call(rank: int, ranks: int, wait: str, on_rank: int, engine: str) -> str:
    """One rank's call with `wait` withheld on rank `on_rank` (after a clean call, so that the
    kernels are loaded and the ranks are in step). Raises the call's error with the seconds it took.
    Prints a line at each step, and its stacks after STACKS_AFTER seconds."""
    import faulthandler

    import torch

    from megamoe import multirank

    faulthandler.dump_traceback_later(STACKS_AFTER, exit=False)
    layer, inp = layer_and_inputs(ranks, rank, engine, multirank.group() if ranks > 1 else None)
    args = (inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    _progress(rank, "layer made")
    layer(*args)
    torch.cuda.synchronize()
    _progress(rank, "clean call done")
    if rank == on_rank:
        layer.withhold(wait)
    _progress(rank, f"{'withheld' if rank == on_rank else 'peer'} call launched")
    start = time.monotonic()
    try:
        with layer.named_failures():
            layer(*args)
            torch.cuda.synchronize()
    except Exception as exc:
        raise RuntimeError(f"after {time.monotonic() - start:.1f} s: {exc}") from exc
    return "no error"


_SCRIPT = """
import faulthandler, sys
from bench.hangs import STACKS_AFTER, withheld_call
from megamoe import multirank
faulthandler.dump_traceback_later(STACKS_AFTER, exit=False)
wait, ranks, on_rank, engine = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if ranks == 1:
    print("RESULT", withheld_call(0, 1, wait, on_rank, engine))
else:
    try:
        print("RESULT", multirank.spawn(withheld_call, ranks, args=(wait, on_rank, engine), timeout=300))
    except multirank.RankFailed as e:
        print("RANKFAILED", e.rank)
        print(e)
"""


def run_site(wait: str, ranks: int, on_rank: int, engine: str, timeout: float = 90) -> str:
    """A site in a new process: everything it printed (the error with its record, or RESULT), or,
    if it has not ended after `timeout` seconds (three times the 30 s bar), that and what it printed
    so far: its steps and, past STACKS_AFTER, its processes' stacks. The process is killed then."""
    cmd = [sys.executable, "-c", _SCRIPT, wait, str(ranks), str(on_rank), engine]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        printed = "".join(x.decode() if isinstance(x, bytes) else x for x in (e.stdout, e.stderr) if x)
        return f"NOT ENDED after {timeout:.0f} s; it printed: {printed}"
    return run.stdout + run.stderr


_SECONDS = re.compile(r"RuntimeError: after ([0-9.]+) s:")
_RECORD = re.compile(r"\[the kernel trapped: ([^\]]+)\]")


def _row(site, out: str) -> str:
    """A site's table row from its process's output. The seconds and the record are searched in
    the whole output: the record follows CUDA's several-line message, and a traceback also shows
    the source line that formats "after ... s:" (read literally, that is no time)."""
    wait, ranks, on_rank, engine = site
    seconds = _SECONDS.search(out)
    failed = next((ln.split()[1] for ln in out.splitlines() if ln.startswith("RANKFAILED")), "-")
    # The failed rank's record (its peers' waits time out in turn and print theirs), the last one
    # printed: a traceback quotes the line that formats it ("{record}").
    records = [m for m in _RECORD.finditer(out) if "{" not in m.group(1)]
    record = next((m for m in reversed(records) if m.group(1).startswith(f"rank {failed},")), None)
    record = record or (records[-1] if records else None)
    what = record.group(1) if record else " ".join(out.split())[-160:]
    return f"| {wait} | {ranks} | {on_rank} | {engine} | {failed} | {seconds.group(1) if seconds else '-'} | {what} |"


def main() -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench.hangs needs a CUDA GPU (it makes the kernel's waits time out)")
    start = time.monotonic()
    print("| wait withheld | R | on rank | engine | rank named by spawn | s to the error | record |")
    print("|---|---|---|---|---|---|---|", flush=True)
    # Each row as its site ends, so that a site that never ends still leaves the others' rows.
    with ThreadPoolExecutor(len(SITES)) as ex:
        futures = {ex.submit(run_site, *site): site for site in SITES}
        for done in as_completed(futures):
            print(_row(futures[done], done.result()), flush=True)
    print(f"\n{len(SITES)} sites in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
