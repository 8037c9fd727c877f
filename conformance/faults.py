"""The fault catalog: planted faults that the checkers must catch, each at its named dump point.

Each fault is a small function that changes one stage's output while the simulated call runs
(through the reference pipeline's tamper hook); the stages after it then work on the changed
values, like a kernel with one broken stage. The suite must report the fault at `point` with
every earlier point clean. A checker that cannot fail is a defect: this catalog is its proof.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from megamoe import reference as ref
from megamoe.reference import formats as F
from megamoe.reference import points as P
from megamoe.reference.pipeline import StageContext

from .dump import Dump, reference_dumps
from .suite import SuiteReport, check

# The catalog's call: 2 ranks, skewed routing with masked slots, a clamp that bites on both sides.
SCENARIO = ref.MoEConfig(
    hidden=256,
    intermediate=128,
    num_experts=8,
    top_k=4,
    num_ranks=2,
    max_tokens_per_rank=48,
    block_m=16,
    activation_clamp=1.5,
    fast_math=True,
)
TOKENS = [48, 33]
OVERFLOW_TOKEN = 0  # in the "overflow" scenario, rank 0's token 0 has scale bytes 254: acc1 overflows
ORDER_TOKEN = 1  # in the "clamped" scenario, rank 0's token 1 makes the combine order visible


def scenario_inputs(name: str = "clamped", seed: int = 0):
    """The inputs of a catalog scenario: 'clamped' (default) or 'overflow' (no clamp, one token
    whose L1 accumulators overflow to ±inf, the only way E4M3 saturation can occur)."""
    cfg = SCENARIO if name == "clamped" else dataclasses.replace(SCENARIO, activation_clamp=None)
    inputs = ref.make_inputs(cfg, TOKENS, seed=seed, distribution="skewed", masked_ratio=0.15)
    weights = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=seed)
    if name == "overflow":
        inputs[0].x_sf[OVERFLOW_TOKEN] = 254
        inputs[0].topk_idx[OVERFLOW_TOKEN] = torch.tensor([0, 1, 2, 3])
    else:
        # A token whose combine sum depends on the order: experts 0 and 1 are exact negatives
        # (same w1, w2 with every FP4 sign bit flipped) under a large routing weight, so slots 0
        # and 1 cancel exactly and only the small slots 2 and 3 survive; summed in another order,
        # they are lost against the large partial sums.
        weights.w1[1], weights.w1_sf[1], weights.w2_sf[1] = weights.w1[0], weights.w1_sf[0], weights.w2_sf[0]
        weights.w2[1] = weights.w2[0] ^ 0x88
        inputs[0].topk_idx[ORDER_TOKEN] = torch.tensor([0, 1, 2, 3])
        inputs[0].topk_weights[ORDER_TOKEN] = torch.tensor([2.0**10, 2.0**10, 2.0**-10, 2.0**-10])
    return cfg, inputs, weights


@dataclass(frozen=True)
class Fault:
    name: str
    point: str  # the dump point where the suite must catch it
    description: str
    apply: Callable[[dict, StageContext], None]
    scenario: str = "clamped"
    rank: int = 0  # the rank whose stage output is changed


CATALOG: list[Fault] = []


def fault(point: str, description: str, *, scenario: str = "clamped", rank: int = 0):
    def register(fn):
        CATALOG.append(Fault(fn.__name__, point, description, fn, scenario, rank))
        return fn

    return register


# ------------------------------------------------------------------------------------ helpers


def _valid(d):
    return ref.valid_rows(d)


def _first_valid_row(d, skip: int = 0) -> int:
    return int(_valid(d).nonzero()[skip])


def _gemm(d, codes, sf, w, w_sf):
    return ref.grouped_gemm(codes, sf, d[P.D4_EXPERT_OFFSETS], w, w_sf, valid=_valid(d))


def _l1(d, ctx, **kw):
    return _gemm(
        d,
        kw.get("x", d[P.D4_POOL_X]),
        kw.get("x_sf", d[P.D4_POOL_X_SF]),
        kw.get("w", ctx.weights.w1),
        kw.get("w_sf", ctx.weights.w1_sf),
    )


def _interleave(rows: torch.Tensor, g: int) -> torch.Tensor:
    n, i = rows.shape[0], rows.shape[0] // 2
    return torch.stack([rows[:i].reshape(i // g, g, -1), rows[i:].reshape(i // g, g, -1)], 1).reshape(n, -1)


def _deinterleave(rows: torch.Tensor, g: int) -> torch.Tensor:
    i = rows.shape[0] // 2
    b = rows.reshape(i // g, 2, g, -1)
    return torch.cat([b[:, 0].reshape(i, -1), b[:, 1].reshape(i, -1)])


def _activation(d, ctx, *, bf16=True, clamp="cfg", both_sides=False, weight=True):
    cfg = ctx.cfg
    acc, i = d[P.D5_ACC1], cfg.intermediate
    g = F.round_bf16(acc[:, :i])
    u = F.round_bf16(acc[:, i:]) if bf16 else acc[:, i:]
    c = cfg.activation_clamp if clamp == "cfg" else clamp
    if c is not None:
        c = F.round_bf16(torch.tensor([c], dtype=torch.float32))
        g = torch.clamp(g, -c, c) if both_sides else torch.minimum(g, c)
        u = torch.clamp(u, -c, c)
    s = ref.silu_table(cfg.fast_math)[F.encode_bf16(g).long()]
    w = d[P.D4_POOL_WEIGHTS][:, None] if weight else torch.ones_like(d[P.D4_POOL_WEIGHTS])[:, None]
    a = (s * u) * w
    return torch.where(_valid(d)[:, None], a, torch.zeros_like(a))


def _set_d6(d, codes, sf):
    d[P.D6_L2_ACTS], d[P.D6_L2_SF] = codes, sf


def _requant(a: torch.Tensor, *, group=32, rule="rceil", cast="rne", overflow="saturate"):
    p, n = a.shape
    grp = a.reshape(p, n // group, group)
    mag = grp.abs()
    amax = torch.where(torch.isnan(mag), torch.zeros_like(mag), mag).amax(-1)
    if rule == "rceil":
        e = F.ceil_exponent(amax * F.INV_E4M3_MAX)
    else:  # OCP FLOOR: floor(log2 amax) - emax(E4M3) = 8
        e = torch.where(
            amax > 0, ((F.f32_bits(amax) >> 23) & 0xFF) - 127 - 8, torch.full_like(amax, -127, dtype=torch.int32)
        )
    scaled = grp * F.pow2_f32(-e).unsqueeze(-1)
    if cast == "trunc":  # round toward zero onto the E4M3 grid (codes 0..0x7E ascend in magnitude)
        grid = F.decode_e4m3(torch.arange(0x7F, dtype=torch.uint8))
        idx = torch.searchsorted(grid, scaled.abs().clamp(max=448).contiguous(), right=True) - 1
        scaled = torch.where(scaled < 0, -grid[idx], grid[idx])
    codes = F.encode_e4m3(scaled)
    if overflow == "nan":
        codes = torch.where(torch.isinf(scaled), torch.full_like(codes, 0x7F), codes)
    sf = (e + 127).to(torch.uint8)
    sf32 = sf.repeat_interleave(group // 32, dim=1)
    return codes.reshape(p, n), sf32


# ------------------------------------------------------------------------------------ dispatch


@fault(P.D1, "a send count off by one")
def send_count_off_by_one(d, ctx):
    e = int(d[P.D1_SEND_COUNTS].argmax())
    d[P.D1_SEND_COUNTS][e] += 1


@fault(P.D1, "a -1 slot treated as expert 0")
def minus_one_slot_counted_as_expert_0(d, ctx):
    d[P.D1_SEND_COUNTS][0] += int((ctx.inputs[ctx.rank].topk_idx < 0).sum())


@fault(P.D2, "receive counts of two source ranks swapped")
def recv_counts_sources_swapped(d, ctx):
    c = d[P.D2_RECV_COUNTS]
    d[P.D2_RECV_COUNTS] = torch.stack([c[1], c[0]]) if not torch.equal(c[0], c[1]) else c + 1


@fault(P.D2, "N_e missing one source rank")
def recv_totals_missing_a_source(d, ctx):
    d[P.D2_RECV_TOTALS] = d[P.D2_RECV_TOTALS] - d[P.D2_RECV_COUNTS][1]


@fault(P.D3, "an entry dropped from a source list")
def source_list_entry_dropped(d, ctx):
    lists = d[P.D3_SOURCE_LISTS]
    lists[tuple((lists >= 0).nonzero()[0])] = -1


@fault(P.D3, "a source-list entry names another token")
def source_list_wrong_token(d, ctx):
    lists = d[P.D3_SOURCE_LISTS]
    lists[tuple((lists >= 0).nonzero()[0])] += ctx.cfg.top_k


# ------------------------------------------------------------------------------------ pool


@fault(P.D4, "a token dropped from the pool (its row marked empty)")
def token_dropped(d, ctx):
    d[P.D4_POOL_META][_first_valid_row(d)] = -1


@fault(P.D4, "a token duplicated over its neighbour's row")
def token_duplicated(d, ctx):
    p = _first_valid_row(d)
    for name in (P.D4_POOL_X, P.D4_POOL_X_SF, P.D4_POOL_WEIGHTS, P.D4_POOL_META):
        d[name][p + 1] = d[name][p]


@fault(P.D4, "two slots swapped across tokens (metadata only)")
def slots_swapped_across_tokens(d, ctx):
    m = d[P.D4_POOL_META]
    p = _first_valid_row(d)
    q = next(r for r in _valid(d).nonzero().flatten().tolist() if m[r, 1] != m[p, 1])
    m[[p, q]] = m[[q, p]]


@fault(P.D4, "a wrong source rank in the metadata")
def wrong_metadata_rank(d, ctx):
    p = _first_valid_row(d)
    d[P.D4_POOL_META][p, 0] = (d[P.D4_POOL_META][p, 0] + 1) % ctx.cfg.num_ranks


@fault(P.D4, "a stale row left from the previous call")
def stale_row_from_previous_call(d, ctx):
    p = _first_valid_row(d)
    d[P.D4_POOL_X][p] = torch.roll(d[P.D4_POOL_X][p], 1)


@fault(P.D4, "scale bytes not pulled with the row")
def scale_bytes_not_pulled(d, ctx):
    d[P.D4_POOL_X_SF][_first_valid_row(d)] = 0


@fault(P.D4, "routing weight taken from the next slot")
def routing_weight_from_wrong_slot(d, ctx):
    for p in _valid(d).nonzero().flatten().tolist():
        s, t, k = d[P.D4_POOL_META][p].tolist()
        other = ctx.inputs[s].topk_weights[t, (k + 1) % ctx.cfg.top_k]
        if other != d[P.D4_POOL_WEIGHTS][p]:
            d[P.D4_POOL_WEIGHTS][p] = other
            return


@fault(P.D4, "an arrival counter off by one")
def arrival_counter_off_by_one(d, ctx):
    d[P.D4_BLOCK_ARRIVALS][0] -= 1


@fault(P.D4, "an expert region not BLOCK_M-aligned")
def expert_region_misaligned(d, ctx):
    d[P.D4_EXPERT_OFFSETS][1:-1] += 1


# ------------------------------------------------------------------------------------ L1


@fault(P.D5, "gate and up swapped")
def gate_up_swapped(d, ctx):
    i = ctx.cfg.intermediate
    d[P.D5_ACC1] = torch.cat([d[P.D5_ACC1][:, i:], d[P.D5_ACC1][:, :i]], dim=1)


@fault(P.D5, "gate/up de-interleaved with granularity 4 instead of 8")
def interleave_4_instead_of_8(d, ctx):
    d[P.D5_ACC1] = _deinterleave(_interleave(d[P.D5_ACC1].T, 8), 4).T.contiguous()


@fault(P.D5, "FP4 nibble order swapped")
def fp4_nibbles_swapped(d, ctx):
    w = ctx.weights.w1
    d[P.D5_ACC1] = _l1(d, ctx, w=(w >> 4) | (w << 4))


@fault(P.D5, "a weight scale byte off by one")
def weight_scale_byte_off_by_one(d, ctx):
    sf = ctx.weights.w1_sf.clone()
    sf[:, 0, 0] += 1
    d[P.D5_ACC1] = _l1(d, ctx, w_sf=sf)


@fault(P.D5, "activation scales shifted by one group")
def activation_scales_shifted(d, ctx):
    d[P.D5_ACC1] = _l1(d, ctx, x_sf=torch.roll(d[P.D4_POOL_X_SF], 1, dims=1))


@fault(P.D5, "an accumulator perturbed beyond tau")
def l1_accumulator_perturbed(d, ctx):
    p = _first_valid_row(d)
    d[P.D5_ACC1][p, 3] += 2**-8 * (d[P.D5_ACC1][p, 3].abs() + 1)


# ------------------------------------------------------------------------------------ SwiGLU/requant


@fault(P.D6, "accumulators not rounded to bf16 before SwiGLU")
def no_bf16_rounding(d, ctx):
    _set_d6(d, *_requant(_activation(d, ctx, bf16=False)))


@fault(P.D6, "clamp skipped")
def clamp_skipped(d, ctx):
    _set_d6(d, *_requant(_activation(d, ctx, clamp=None)))


@fault(P.D6, "clamp applied to both sides of gate")
def clamp_both_sides_of_gate(d, ctx):
    _set_d6(d, *_requant(_activation(d, ctx, both_sides=True)))


@fault(P.D6, "routing weight left for combine instead of applied before requant")
def routing_weight_at_combine(d, ctx):
    _set_d6(d, *_requant(_activation(d, ctx, weight=False)))


@fault(P.D6, "a requant scale byte off by one")
def requant_scale_byte_off_by_one(d, ctx):
    d[P.D6_L2_SF][_first_valid_row(d), 1] += 1


@fault(P.D6, "requant scales shifted by one group")
def requant_scales_shifted(d, ctx):
    d[P.D6_L2_SF] = torch.roll(d[P.D6_L2_SF], 1, dims=1)


@fault(P.D6, "amax over 128 channels instead of 32")
def per_128_amax(d, ctx):
    _set_d6(d, *_requant(_activation(d, ctx), group=128))


@fault(P.D6, "floor (OCP) scale instead of RCEIL")
def floor_instead_of_rceil(d, ctx):
    _set_d6(d, *_requant(_activation(d, ctx), rule="floor"))


@fault(P.D6, "truncation instead of RNE in the FP8 cast")
def truncation_instead_of_rne(d, ctx):
    _set_d6(d, *_requant(_activation(d, ctx), cast="trunc"))


@fault(P.D6, "NaN instead of saturation in the FP8 cast", scenario="overflow")
def nan_instead_of_saturation(d, ctx):
    _set_d6(d, *_requant(_activation(d, ctx), overflow="nan"))


@fault(P.D6, "an L1-completion count off by one")
def l1_done_off_by_one(d, ctx):
    d[P.D6_L1_DONE][0] -= 1


# ------------------------------------------------------------------------------------ L2


@fault(P.D7, "an L2 accumulator perturbed beyond tau")
def l2_accumulator_perturbed(d, ctx):
    p = _first_valid_row(d)
    d[P.D7_ACC2][p, 7] += 2**-8 * (d[P.D7_ACC2][p, 7].abs() + 1)


@fault(P.D7, "the next expert's L2 weights")
def l2_wrong_expert_weights(d, ctx):
    w, sf = torch.roll(ctx.weights.w2, 1, dims=0), torch.roll(ctx.weights.w2_sf, 1, dims=0)
    d[P.D7_ACC2] = _gemm(d, d[P.D6_L2_ACTS], d[P.D6_L2_SF], w, sf)


def _first_slot(ctx) -> tuple[int, int]:
    t, k = (ctx.inputs[ctx.rank].topk_idx >= 0).nonzero()[0].tolist()
    return k, t


@fault(P.D8, "a padding row written into a combine slot")
def padding_row_leaks(d, ctx):
    k, t = _first_slot(ctx)
    d[P.D8_COMBINE][k, t] = 0  # a padding row's accumulator is zero


@fault(P.D8, "a combine row truncated to bf16 instead of RNE")
def combine_row_truncated(d, ctx):
    k, t = _first_slot(ctx)
    row = d[P.D8_COMBINE][k, t]
    acc = row.float() + row.float().abs() * 2**-9  # a value between bf16 neighbours ...
    d[P.D8_COMBINE][k, t] = F.bf16_tensor(F.f32_bits(acc) >> 16)  # ... cut, not rounded


@fault(P.D8, "half of an output row left unwritten")
def half_written_row(d, ctx):
    k, t = _first_slot(ctx)
    d[P.D8_COMBINE][k, t, ctx.cfg.hidden // 2 :] = float("nan")


@fault(P.D8, "a row written to the wrong slot")
def combine_row_wrong_slot(d, ctx):
    idx = ctx.inputs[ctx.rank].topk_idx
    t = int(((idx >= 0).sum(1) >= 2).nonzero()[0])
    k0, k1 = (idx[t] >= 0).nonzero().flatten()[:2].tolist()
    d[P.D8_COMBINE][k0, t] = d[P.D8_COMBINE][k1, t]


# ------------------------------------------------------------------------------------ combine


def _combine_variant(d, ctx, order=None, dtype=torch.float32, weighted=False, skip_masked=True):
    idx = ctx.inputs[ctx.rank].topk_idx
    buf = d[P.D8_COMBINE]
    t, k = idx.shape
    acc = torch.zeros(t, buf.shape[2], dtype=dtype)
    for slot in order or range(k):
        v = buf[slot, :t].to(dtype)
        if weighted:
            v = v * ctx.inputs[ctx.rank].topk_weights[:, slot, None].to(dtype)
        ok = (idx[:, slot] >= 0)[:, None] if skip_masked else torch.ones(t, 1, dtype=torch.bool)
        acc = torch.where(ok, acc + v, acc)
    d[P.D9_Y] = F.bf16_tensor(F.encode_bf16(acc.float()))


@fault(P.D9, "combine summed in reverse slot order")
def combine_reverse_order(d, ctx):
    _combine_variant(d, ctx, order=list(reversed(range(ctx.cfg.top_k))))


@fault(P.D9, "combine accumulated in bf16")
def combine_in_bf16(d, ctx):
    _combine_variant(d, ctx, dtype=torch.bfloat16)


@fault(P.D9, "routing weight applied (again) at combine")
def routing_weight_applied_at_combine(d, ctx):
    _combine_variant(d, ctx, weighted=True)


@fault(P.D9, "a -1 slot summed")
def masked_slot_summed(d, ctx):
    _combine_variant(d, ctx, skip_masked=False)


@fault(P.D9, "half of an output row of y unwritten")
def y_half_written(d, ctx):
    d[P.D9_Y][0, ctx.cfg.hidden // 2 :] = 0


# ------------------------------------------------------------------------------------ cleanup


@fault(P.D10, "counters not reset after the call")
def counters_not_reset(d, ctx):
    d[P.D10_COUNTERS] = torch.tensor([0, 3, 0], dtype=torch.int32)


@fault(P.D10, "cumulative statistics not added")
def stats_not_added(d, ctx):
    d[P.D10_RECV_STATS] = d[P.D10_RECV_STATS] - d[P.D2_RECV_TOTALS].long()


@fault(P.D10, "cumulative statistics added twice")
def stats_added_twice(d, ctx):
    d[P.D10_RECV_STATS] = d[P.D10_RECV_STATS] + d[P.D2_RECV_TOTALS].long()


# ------------------------------------------------------------------------------------ running it


def planted(f: Fault, seed: int = 0) -> list[Dump]:
    """The dumps of the catalog scenario with fault `f` planted."""
    cfg, inputs, weights = scenario_inputs(f.scenario, seed)

    def tamper(point, dump, ctx):
        if point == f.point and ctx.rank == f.rank:
            f.apply(dump, ctx)

    return reference_dumps(cfg, inputs, weights, tamper=tamper)


@dataclass
class FaultOutcome:
    fault: Fault
    report: SuiteReport

    @property
    def caught_where_expected(self) -> bool:
        return self.report.first_failure == self.fault.point


def run_catalog(seed: int = 0, progress: Callable[[str], None] | None = None) -> list[FaultOutcome]:
    out = []
    for n, f in enumerate(CATALOG, 1):
        if progress:
            progress(f"fault {n}/{len(CATALOG)}: {f.name}")
        out.append(FaultOutcome(f, check(planted(f, seed))))
    return out
