"""The GEMM core's choices that a launch's arguments leave open: which path or engine a call runs on
and with which kernel specialisation.

* the standalone GEMMs (megamoe.gemm): the prefill path or the swap-AB kernel (use_prefill, with
  its crossovers PREFILL_MIN_TOKENS and PREFILL_MIN_MEAN_ROWS; prefill_path, the caller's choice
  checked), the swap-AB kernel's largest token tile (pick_max_tile) and consumer warpgroups
  (pick_wgs), the specialisation of a launch (spec_for) and every one the tests and the benchmark
  launch (used_specs);
* the fused layer (megamoe.moe): its GEMM engine per call (choose_engine, FUSED_PREFILL_MIN_ROWS).
"""

from __future__ import annotations

import dataclasses

from megamoe import reference as ref
from megamoe.reference import MegaMoEInputError
from megamoe.reference.config import ACTIVATIONS
from megamoe.reference.errors import fail

from .jit import build as jb
from .jit import contract

PROMOTIONS = jb.PROMOTIONS

# The prefill path: from this many tokens in the largest expert and per expert on average
# (use_prefill), keyed by (promotion, layer), a launch decodes its weights once into E4M3 tiles (the
# predecode pass, ~4 TB/s) and runs the prefill GEMM (tokens as wgmma M) instead of the swap-AB
# kernel, which decodes every weight tile once per token block. Measured crossovers (DSV3,
# graph-timed, same call): fast mode (bench/NOTES.md v16) L1 (K = H) 0.80x the swap-AB kernel at 256
# tokens, 1.10x at 512, 1.27x at 1024; L2 (K = I = 2048: a short mainloop per item) 0.82x at 256,
# 1.10x at 512, 1.22x at 1024. Exact mode (v17; two FP32 instructions per accumulator and k32 step
# in both kernels, so the pass pays off early): L1 1.03x at 128 tokens, 1.26x at 256; L2 1.06x,
# 1.28x. With the fold (v18) it wins from 65 tokens, past the exact swap-AB kernel's largest tile
# (64), where an expert costs that kernel two token blocks: L1 1.39x at 96 tokens, 0.71x at 64; L2
# 1.41x, 0.73x. The mean pool rows per expert (PREFILL_MIN_MEAN_ROWS) count each expert's padding
# to 64, so the exact mode asks for two blocks' worth there: at 65 the Zipf routing of 8 tokens
# per expert (largest 100, mean 68 rows) would take the pass, which alone costs more than its
# swap-AB launch (358 against 330 us at DSV3 L1).
PREFILL_MIN_TOKENS = {("k128", 1): 512, ("k128", 2): 512, ("k32", 1): 65, ("k32", 2): 65}
PREFILL_MIN_MEAN_ROWS = {("k128", 1): 512, ("k128", 2): 512, ("k32", 1): 128, ("k32", 2): 128}
PREFILL_ROWS = contract.PREFILL_ROWS


def prefill_path(
    layer: int, prefill, max_tokens, rows_per_expert: float, promotion: str, n_rows: int, arrival, max_tile, wgs
) -> bool:
    """The entry points' choice: the caller's `prefill`, else use_prefill without a gate or a forced
    specialisation. A forced prefill path the launch cannot take is an input error."""
    if prefill is None:
        return (
            arrival is None
            and max_tile is None
            and wgs is None
            and use_prefill(layer, max_tokens, rows_per_expert, promotion, n_rows)
        )
    if prefill:
        if n_rows % PREFILL_ROWS[promotion]:
            raise MegaMoEInputError(
                f"argument 'prefill': weight rows must be a multiple of {PREFILL_ROWS[promotion]}"
                f" (promotion {promotion!r}), got {n_rows}"
            )
        if arrival is not None:
            fail("prefill", "no arrival gate (the prefill path is standalone)", "an arrival tensor")
        if max_tile is not None or wgs is not None:
            fail("prefill", "no max_tile / wgs (they force a swap-AB kernel)", f"max_tile={max_tile}, wgs={wgs}")
    return bool(prefill)


def use_prefill(layer: int, max_tokens: int | None, rows_per_expert: float, promotion: str, n_rows: int) -> bool:
    """Whether a launch of `layer` takes the prefill path by default: weight rows a multiple of
    PREFILL_ROWS[promotion],
    the largest expert (max_tokens, if known) at least PREFILL_MIN_TOKENS[(promotion, layer)] and
    the mean pool rows per expert (rows_per_expert: the pool's rows over its experts, padding
    included) at least PREFILL_MIN_MEAN_ROWS[(promotion, layer)]. The mean matters because the
    predecode pass decodes every expert's weights: under a skewed routing whose largest expert has
    676 of 2048 tokens (32 experts) the prefill path took 648 us at DSV3 L1 against 299 us for the
    swap-AB kernel (bench/NOTES.md v15)."""
    need = PREFILL_MIN_TOKENS.get((promotion, layer))
    return (
        need is not None
        and max_tokens is not None
        and max_tokens >= need
        and rows_per_expert >= PREFILL_MIN_MEAN_ROWS[(promotion, layer)]
        and n_rows % PREFILL_ROWS[promotion] == 0
    )


def pick_max_tile(max_tokens: int | None, promotion: str = "k128", rows_per_expert: float | None = None) -> int:
    """The kernel's largest token tile for a launch whose largest expert has max_tokens rows: the
    smallest tile that holds them, at most the promotion's largest (256 for k128, 64 for k32;
    larger experts take several items). Unknown (None): the largest. A skewed launch (pool rows per
    expert, rows_per_expert, under 128 while some expert has more than 64) takes 64: its middle-sized
    experts would pay a 128-token tile for few rows (measured on zipf routings: 1.6x at 8 and 1.3x
    at 64 tokens per expert faster than at 128)."""
    top = jb.max_tile_of(promotion)
    if max_tokens is None:
        return top
    if top > 64 and max_tokens > 64 and rows_per_expert is not None and rows_per_expert < 128:
        return 64
    for tile in contract.TOKEN_TILES:
        if max_tokens <= tile or tile == top:
            return tile
    return top


def pick_wgs(max_tile: int, n_rows: int, promotion: str) -> int:
    """Consumer warpgroups per CTA: 4 (256 weight rows per CTA, 20 warps) up to the promotion's
    jb.max_wgs4_tile (8 tokens in the exact mode, 64 in the fast mode), where more warps per
    scheduler hide the per-stage latency; 2 otherwise (the 640 x 96 launch registers leave 4
    consumer warpgroups 104 each, too few for larger tiles)."""
    return 4 if max_tile <= jb.max_wgs4_tile(promotion) and n_rows % 256 == 0 else 2


def spec_for(
    layer: int,
    *,
    promotion: str = "k32",
    fast_math: bool = True,
    debug: bool = False,
    max_tokens: int | None = None,
    n_rows: int = 256,
    max_tile: int | None = None,
    wgs: int | None = None,
    rows_per_expert: float | None = None,
) -> jb.GemmSpec:
    if promotion not in PROMOTIONS:
        fail("promotion", f"one of {PROMOTIONS}", repr(promotion))
    tile = pick_max_tile(max_tokens, promotion, rows_per_expert) if max_tile is None else max_tile
    if tile not in contract.TOKEN_TILES:
        fail("max_tile", f"one of {contract.TOKEN_TILES}", repr(tile))
    return jb.GemmSpec(
        layer=layer,
        max_tile=tile,
        promotion=promotion,
        fast_math=bool(fast_math) if layer == 1 else True,
        debug=debug,
        wgs=pick_wgs(tile, n_rows, promotion) if wgs is None else wgs,
    )


def used_specs() -> list[jb.GemmSpec]:
    """Every specialisation the GPU tests and the benchmark launch (the CI compile gate builds these)."""
    specs = []
    for promotion in PROMOTIONS:
        for debug in (False, True):
            for tile in (t for t in contract.TOKEN_TILES if t <= jb.max_tile_of(promotion)):
                for wgs in (2, 4) if tile <= jb.max_wgs4_tile(promotion) else (2,):
                    for fast_math in (True, False):
                        specs.append(
                            jb.GemmSpec(
                                layer=1, max_tile=tile, promotion=promotion, fast_math=fast_math, debug=debug, wgs=wgs
                            )
                        )
                    specs.append(
                        jb.GemmSpec(layer=2, max_tile=tile, promotion=promotion, fast_math=True, debug=debug, wgs=wgs)
                    )
    for promotion in PROMOTIONS:
        for debug in (False, True):
            specs += [
                jb.PrefillSpec(layer=1, fast_math=True, debug=debug, promotion=promotion),
                jb.PrefillSpec(layer=1, fast_math=False, debug=debug, promotion=promotion),
                jb.PrefillSpec(layer=2, fast_math=True, debug=debug, promotion=promotion),
            ]
    return specs + [jb.PredecodeSpec(promotion=promotion) for promotion in PROMOTIONS]


def fused_specs() -> list[jb.FusedSpec]:
    """Every specialisation of the fused layer's kernel (promotion, engine, activation, its table,
    debug): what MegaMoE can launch (the CI compile gate builds these too)."""
    return [
        jb.FusedSpec(fast_math=fm, debug=dbg, promotion=promotion, engine=engine, activation=activation)
        for promotion, engine in jb.FUSED_MODES
        for activation in ACTIVATIONS
        for fm in (True, False)
        for dbg in (False, True)
    ]


def timeline_specs() -> list[jb.FusedSpec]:
    """The fused kernel's timeline builds (measurement builds: megamoe.timeline, bench.timeline), which
    the CI compile gate builds too: every release build's twin."""
    return [dataclasses.replace(spec, timeline=True) for spec in fused_specs() if not spec.debug]


# The prefill engine from this many expected pool rows per local expert (choose_engine), per
# promotion. Measured on the DSV3 slice (bench/NOTES.md v21, one call, us, swap-AB / prefill
# engine): fast mode 986 / 1338 at 128 rows (T = 512), 3466 / 2552 at 512; exact mode 845 / 1470 at
# 16 rows, 2004 / 1841 at 128. Between the measured points: 256 (fast), 128 (exact).
FUSED_PREFILL_MIN_ROWS = {"k128": 256, "k32": 128}

# The same for a layer whose weights are predecoded (MegaMoE(predecoded=True)): its prefill calls
# have no predecode phase, so the engine wins from fewer rows. Measured on gpt-oss-20b (H100,
# bench/NOTES.md v39, one call, us, the swap-AB engine / the predecoded prefill engine): 491.8 /
# 432.4 at 32 rows (T = 256), 641.5 / 462.6 at 64, 1064.6 / 579.8 at 125 (T = 1000); the narrow
# engine keeps its 8 rows (T = 64: 234.4). Between 8 and 32 rows not measured: 32 (exact). The fast
# mode's predecoded layers are not measured either: its per-call threshold.
FUSED_PREFILL_MIN_ROWS_PREDECODED = {"k128": 256, "k32": 32}

# The exact mode's narrow engine (token tile 8) up to this many expected pool rows per local expert
# (T R K / E, as FUSED_PREFILL_MIN_ROWS). Up to T R = 8 no expert can receive more than 8 rows; past
# it experts of 9-16 rows run in two parts (their weights streamed twice), and still the narrow
# engine won at every size measured: gpt-oss T = 16 / 32 / 64 (2 / 4 / 8 expected rows) 195.5 /
# 204.1 / 266.1 us against the swap-AB engine's 221.8 / 234.2 / 337.7 (bench/NOTES.md v34).
FUSED_NARROW_MAX_ROWS = 8


def choose_engine(
    cfg: ref.MoEConfig, promotion: str, tokens: int, engine: str = "auto", predecoded: bool = False
) -> str:
    """The GEMM engine of a call of `tokens` tokens on this rank: `engine` unless "auto", else the
    prefill engine from FUSED_PREFILL_MIN_ROWS[promotion] expected pool rows per local expert
    (T R K / E: every rank's call as large as this one, routed uniformly; for a layer whose weights
    are `predecoded`, FUSED_PREFILL_MIN_ROWS_PREDECODED's), the narrow engine in the exact mode up
    to FUSED_NARROW_MAX_ROWS of them, else the swap-AB engine. Every engine runs every layer the
    fused kernel takes (SPEC §8's activation and sizes included)."""
    if engine != "auto":
        return engine
    rows = tokens * cfg.num_ranks * cfg.top_k / cfg.num_experts
    narrow = promotion == "k32" and rows <= FUSED_NARROW_MAX_ROWS
    if narrow:
        return "narrow"
    least = (FUSED_PREFILL_MIN_ROWS_PREDECODED if predecoded else FUSED_PREFILL_MIN_ROWS)[promotion]
    return "prefill" if rows >= least else "swapab"
