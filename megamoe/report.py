"""Numeric tolerance report: the reference, or the fused kernel's dumps, against the float64 oracle,
stage by stage.

For every stage with an oracle counterpart it reports calc_diff, the largest absolute error,
the ∞-norm relative error (max |err| / max |oracle|) and a histogram of the error in units of the
last place of a format: the stage's own output format for the stage-local rows (fp32
accumulators, scaled E4M3, bf16 output), bf16 (the layer's output format) for the end-to-end rows.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

from megamoe import reference as ref
from megamoe.reference import points as P

ULP_EDGES = (0.5, 1, 2, 4, 8, 16, 64)
ULP_LABELS = ("0",) + tuple(f"<={e:g}" for e in ULP_EDGES) + (f">{ULP_EDGES[-1]:g}",)


@dataclass(frozen=True)
class OutputFormat:
    name: str
    mbits: int
    emin: int


FP32 = OutputFormat("fp32", 23, -126)
BF16 = OutputFormat("bf16", 7, -126)
E4M3 = OutputFormat("e4m3 (x scale)", 3, -6)


def ulp_of(v: torch.Tensor, fmt: OutputFormat, scale_exp: torch.Tensor | None = None) -> torch.Tensor:
    """The format's unit in the last place at each value of v (float64), optionally for values
    stored as code · 2^scale_exp."""
    v = v.to(torch.float64)
    shift = torch.zeros_like(v) if scale_exp is None else scale_exp.to(torch.float64)
    _, e = torch.frexp(v * torch.exp2(-shift))
    exp = torch.clamp(e.to(torch.float64) - 1, min=fmt.emin)
    return torch.exp2(exp - fmt.mbits + shift)


def ulp_histogram(err_ulps: torch.Tensor) -> dict[str, int]:
    e = err_ulps.flatten()
    counts = {ULP_LABELS[0]: int((e == 0).sum())}
    lo = 0.0
    for label, hi in zip(ULP_LABELS[1:], ULP_EDGES):
        counts[label] = int(((e > lo) & (e <= hi)).sum())
        lo = hi
    counts[ULP_LABELS[-1]] = int((e > lo).sum())
    return counts


def compare(
    stage: str, got: torch.Tensor, oracle: torch.Tensor, fmt: OutputFormat, scale_exp: torch.Tensor | None = None
) -> dict:
    got, oracle = got.to(torch.float64).flatten(), oracle.to(torch.float64).flatten()
    finite = torch.isfinite(got) & torch.isfinite(oracle)
    err = (got - oracle).abs()[finite]
    ulps = err / ulp_of(oracle, fmt, None if scale_exp is None else scale_exp.flatten())[finite]
    peak = float(oracle[finite].abs().max()) if finite.any() else 0.0
    return {
        "stage": stage,
        "format": fmt.name,
        "elements": int(got.numel()),
        "non_finite": int((~finite).sum()),
        "calc_diff": ref.calc_diff(got[finite], oracle[finite]),
        "max_abs_err": float(err.max()) if err.numel() else 0.0,
        "rel_err_inf_norm": float(err.max()) / peak if err.numel() and peak else 0.0,
        "max_ulp": float(ulps.max()) if ulps.numel() else 0.0,
        "ulp_histogram": ulp_histogram(ulps),
    }


def tolerance_report(
    cfg: ref.MoEConfig,
    inputs: list[ref.RankInputs],
    weights: ref.ExpertWeights,
    result: ref.ReferenceResult | None = None,
    log=None,
    source: str = "reference",
) -> dict:
    """Run (or take) the reference and the oracle, and compare them stage by stage. `result` may
    hold any dumps of the layer's points (the kernel's: `kernel_report`); `source` names them."""
    say = log or (lambda msg: None)
    t0 = time.perf_counter()
    if result is None:
        say("running the reference ...")
        result = ref.run_reference(cfg, inputs, weights)
        say(f"reference done in {time.perf_counter() - t0:.2f} s")
    t_ref = time.perf_counter() - t0
    say("running the float64 oracle ...")
    oracle = ref.run_oracle(cfg, inputs, weights)
    e_l = cfg.local_experts
    rows: dict[str, list] = {}

    def add(key: str, got: torch.Tensor, want: torch.Tensor, scale_exp: torch.Tensor | None = None) -> None:
        got_l, want_l, sc_l = rows.setdefault(key, ([], [], []))
        got_l.append(got.flatten())
        want_l.append(want.flatten())
        if scale_exp is not None:
            sc_l.append(scale_exp.flatten())

    for rank, (dump, orc) in enumerate(zip(result.dumps, oracle)):
        v = orc.valid
        meta = dump[P.D4_POOL_META]
        local = weights.slice(rank * e_l, (rank + 1) * e_l)
        add("D5", dump[P.D5_ACC1][v], orc.acc1[v])
        deq = ref.dequantize_e4m3(dump[P.D6_L2_ACTS], dump[P.D6_L2_SF])
        scale_exp = (dump[P.D6_L2_SF].to(torch.int64) - 127).repeat_interleave(32, dim=1)
        b1 = None if local.b1 is None else ref.bias_rows(local.b1, dump[P.D4_EXPERT_OFFSETS], v.numel())
        local_act = ref.swiglu_f64(dump[P.D5_ACC1], dump[P.D4_POOL_WEIGHTS], v, cfg.activation_clamp, cfg=cfg, b1=b1)
        add("D6 local", deq[v], local_act[v], scale_exp[v])
        add("D6", deq[v], orc.activation[v])
        local_acc2 = ref.grouped_gemm(
            dump[P.D6_L2_ACTS],
            dump[P.D6_L2_SF],
            dump[P.D4_EXPERT_OFFSETS],
            local.w2,
            local.w2_sf,
            valid=meta[:, 0] >= 0,
            fn=ref.block_scaled_gemm_f64,
        )
        add("D7 local", dump[P.D7_ACC2][v], local_acc2[v])
        add("D7", dump[P.D7_ACC2][v], orc.acc2[v])
        y = result.y[rank].to(torch.float32)
        add("D9 local", y, ref.combine_f64(dump[P.D8_COMBINE], inputs[rank].topk_idx))
        add("D9", y, orc.y)

    def stage(name: str, key: str, fmt: OutputFormat) -> dict:
        got_l, want_l, sc_l = rows.get(key, ([], [], []))

        def cat(xs: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(xs) if xs else torch.zeros(0, dtype=torch.float64)

        return compare(name, cat(got_l), cat(want_l), fmt, cat(sc_l) if sc_l else None)

    # "local": the stage's own rounding, against float64 computed from the stage's own input;
    # "end-to-end": everything up to this stage, against the float64 oracle of the whole layer.
    stages = [
        stage("L1 (D5 acc1) local = end-to-end", "D5", FP32),
        stage("SwiGLU/requant (D6 l2_acts) local", "D6 local", E4M3),
        stage("L2 (D7 acc2) local", "D7 local", FP32),
        stage("combine (D9 y) local", "D9 local", BF16),
        stage("SwiGLU/requant (D6) end-to-end", "D6", BF16),
        stage("L2 (D7) end-to-end", "D7", BF16),
        stage("combine (D9 y) end-to-end", "D9", BF16),
    ]
    return {
        "config": cfg.to_dict(),
        "tokens_per_rank": [inp.num_tokens for inp in inputs],
        "device": str(inputs[0].x.device),
        "source": source,
        "reference_seconds": round(t_ref, 3),
        "stages": stages,
    }


def kernel_report(dumps: list, log=None) -> dict:
    """The same report for the fused kernel: its debug dumps (one per rank, `MegaMoE(...)(...,
    debug=True)`) against the float64 oracle of their own inputs and weights. The local rows take
    each stage's input from the kernel's dumps, so they measure the kernel's own rounding. Dumps
    saved without their weights get them back from their seed (conformance.dump.with_weights).

    The report pairs each pool row with the oracle's row of the same index, so it takes dumps whose
    pool is the reference's, row for row (the fused kernel fills it in that order; SPEC §3 allows
    any), and whole dumps only (not `sample_tokens`'), refusing others in one line."""
    from megamoe.conformance.dump import global_weights, with_weights

    dumps = with_weights(sorted(dumps, key=lambda d: d.rank), progress=log)
    if any(d.sampled for d in dumps):
        ref.errors.fail("dumps", "whole dumps (a sampled dump holds some pool rows only)", "sampled dumps")
    cfg, inputs = dumps[0].config, [d.inputs() for d in dumps]
    for d in dumps:
        pool = ref.build_pool(inputs, d.rank, cfg)
        same = torch.equal(d[P.D4_EXPERT_OFFSETS].cpu().long(), pool.expert_offsets.cpu().long()) and torch.equal(
            d[P.D4_POOL_META].cpu().long()[pool.valid.cpu()], pool.meta.cpu().long()[pool.valid.cpu()]
        )
        if not same:
            ref.errors.fail("dumps", "the reference's pool order (the report pairs rows by index)", f"rank {d.rank}'s")
    result = ref.ReferenceResult(y=[d[P.D9_Y] for d in dumps], dumps=dumps)
    return tolerance_report(cfg, inputs, global_weights(dumps), result, log, source="fused kernel")


# What the table's rows and columns mean; printed under the table (the README's "Command line" says it in short).
LEGEND = """\
- **local** rows: the stage's own rounding only. The stage's input is taken from the dumps of the
  run reported (the reference's, or the fused kernel's own) and the float64 result of that same
  input is the expectation (D6 local: the dumped D5 accumulators through a float64 SwiGLU; D7
  local: the dumped D6 codes times w2 in float64; D9 local: the dumped D8 rows summed in float64).
- **end-to-end** rows: everything up to this stage, against the float64 oracle of the whole layer
  (dequantized inputs and weights, no rounding in between). D6 is dequantized (code x scale) for
  it; the L1 row is both, since its input (the pool) is exact.
- **format**: the format whose ulp (unit in the last place, at the expected value) the ulp
  columns count in: the stage's output format for local rows (fp32 accumulators, E4M3 codes
  times their scale), bf16 (the layer's output format) for end-to-end rows.
- **calc_diff** = 1 - 2 sum(x y) / sum(x^2 + y^2), 0 for identical tensors; **rel err
  (inf-norm)** = max |err| / max |expected|.
- **ulp 0 ... ulp >64**: how many elements have an error of 0 ulp, at most 0.5, 1, 2, ... 64 ulp
  (each bucket excludes the ones before it), or more than 64; **max ulp** is the largest."""


def to_markdown(report: dict) -> str:
    lines = [
        "| stage | format | elements | calc_diff | max abs err | rel err (inf-norm) | max ulp | "
        + " | ".join(f"ulp {label}" for label in ULP_LABELS)
        + " |",
        "|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(ULP_LABELS),
    ]
    for s in report["stages"]:
        hist = " | ".join(str(s["ulp_histogram"][label]) for label in ULP_LABELS)
        lines.append(
            f"| {s['stage']} | {s['format']} | {s['elements']} | {s['calc_diff']:.3e} | "
            f"{s['max_abs_err']:.3e} | {s['rel_err_inf_norm']:.3e} | {s['max_ulp']:.3g} | {hist} |"
        )
    return "\n".join(lines + ["", LEGEND])


def to_json(report: dict) -> str:
    return json.dumps(report, indent=2)
