"""The ring's stage trace (timing only): which role of the narrow engine paces a T-token gpt-oss call.

    python -c "from pathlib import Path; from bench.ab import prepare_tree; \
        prepare_tree('bench/patches/v60_stage_trace_timing_only.patch', Path('/tmp/trace'))"
    cp bench/patches/stage_trace.py /tmp/trace/ && cd /tmp/trace && PYTHONPATH=$PWD python stage_trace.py 8,1

The patch's timeline build stamps `clock64` (one SM, one clock) at points of every ring stage in
CTAs 0-3, indexed by the role's running stage count: the TMA thread before its empty wait (0) and
after the stage's copies (1); the scale warp past the token tile's barrier (2) and after its arrival
(3, items of at most two tokens only); consumer thread 128 before (4) and past (5) the full barrier;
the token side (producer warp 3) before its empty wait (6) and after its copies (7); and at an
item's end, on its last stage, consumer thread 128 after the mainloop (8), after the epilogue or
L1 handoff (9), past the next item's post (10) and at the next item's run_item (11; on the item's
stage before its first). Tokens: a comma list (8,1); STAGE_TRACE_WEIGHTS=FILE keeps the drawn
weights for the next run; STAGE_TRACE_OUT=PREFIX saves the raw stamps (PREFIX_T8.npy, ...).
This prints, per CTA, the medians and sums of the gaps between them: a consumer that waits at the
full barrier is paced by the stream; a TMA thread that waits at the empty barrier, by the consumers.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import numpy as np
import torch

from bench.layer import ROUTINGS, SEED, layer_config, shape_weights
from megamoe import reference as ref
from megamoe.jit import driver
from megamoe.launchers import FusedLauncher
from megamoe.moe import MegaMoE

CTAS, STAGES, SLOTS = 4, 512, 16  # the patch's kTraceCtas, kTraceStages, kTraceSlots
CLOCK_MHZ = 1980  # cycles a µs (the H100's and H200's SM clock)


def weights(cache: str | None) -> ref.ExpertWeights:
    """The benchmark's gpt-oss weights, drawn once (a minute or two on the CPU) and kept in `cache`."""
    if cache and Path(cache).exists():
        return torch.load(cache, weights_only=False).to("cuda")  # our own file: the reference's dataclass
    w = shape_weights("gpt-oss")
    if cache:
        torch.save(w.to("cpu"), cache)
    return w


def main() -> None:
    for tokens in [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "8").split(",")]:
        trace(tokens, weights(os.environ.get("STAGE_TRACE_WEIGHTS")))


def trace(tokens: int, w: ref.ExpertWeights) -> None:
    cfg = layer_config("gpt-oss", tokens)
    layer = MegaMoE(cfg, w, promotion="k32", engine="narrow")
    inp = ref.make_inputs(cfg, tokens, seed=SEED, distribution=ROUTINGS["uniform"], device="cuda")[0]
    kern = FusedLauncher(layer._spec(cfg.fast_math, False, "narrow", timeline=True)).kernel(layer.device.index)
    for i in range(3):  # the last call's stamps, on a trace zeroed before it
        if i == 2:
            torch.cuda.synchronize()
            dptr, size = ctypes.c_uint64(), ctypes.c_size_t()
            lib = driver.lib()
            driver.check(
                lib.cuModuleGetGlobal_v2(ctypes.byref(dptr), ctypes.byref(size), kern.module, b"megamoe_stage_trace"),
                "cuModuleGetGlobal",
            )
            driver.check(lib.cuMemsetD8_v2(dptr, ctypes.c_ubyte(0), size), "cuMemsetD8")
        _, tl = layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights, check_inputs=False, timeline=True)
    torch.cuda.synchronize()
    print(f"gpt-oss T={tokens}, engine narrow: timeline span {tl.span_us:.1f} us")
    raw = driver.module_global(kern.module, "megamoe_stage_trace")
    trace = np.frombuffer(raw, np.uint64).reshape(CTAS, STAGES, SLOTS).astype(np.int64)
    if os.environ.get("STAGE_TRACE_OUT"):  # the raw stamps, for a closer look
        np.save(f"{os.environ['STAGE_TRACE_OUT']}_T{tokens}.npy", trace)
    for cta in range(CTAS):
        s = trace[cta][: int((trace[cta][:, 1] > 0).sum())]
        print(f"CTA {cta}: {len(s)} stages, {(s[-1, 5] - s[0, 0]) / CLOCK_MHZ:.1f} us first stamp to last")
        gaps = [
            ("TMA thread: empty wait + copies", s[:, 1] - s[:, 0]),
            ("copies issued -> scale warp past x_full", s[:, 2] - s[:, 1]),
            ("scale warp: x_full -> its arrival", s[:, 3] - s[:, 2]),
            ("copies issued -> consumer past full", s[:, 5] - s[:, 1]),
            ("consumer: wait at full", s[:, 5] - s[:, 4]),
            ("consumer past full, stage n-1 -> n", np.diff(s[:, 5])),
            ("copies issued, stage n-1 -> n", np.diff(s[:, 1])),
        ]
        if (s[:, 7] > 0).any():  # the narrow engine's token side (producer warp 3), v60
            gaps += [
                ("token side: empty wait + copies", s[:, 7] - s[:, 6]),
                ("token copies -> scale warp past x_full", s[:, 2] - s[:, 7]),
            ]
        for name, v in gaps:
            v = v[np.abs(v) < 10**8]  # an unstamped slot (not a step part) reads 0
            if len(v):
                print(
                    f"  {name:40s} cycles: median {np.median(v):7.0f}, p10 {np.percentile(v, 10):7.0f},"
                    f" p90 {np.percentile(v, 90):7.0f}; sum {v.sum() / CLOCK_MHZ:7.1f} us"
                )


if __name__ == "__main__":
    main()
