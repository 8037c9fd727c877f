"""The `megamoe` command.

    megamoe run      the main job: the MoE layer on the default shape and its tolerance report
                     (a CPU-only machine runs the reference and says so)
    megamoe report   the same report with explicit shape options and JSON / Markdown files
    megamoe check    check recorded dump files stage by stage (exit 1 on any failure)
    megamoe dump     write the reference's expected dumps of a shape to files
    megamoe faults   run the fault catalog: every planted fault must be caught at its stage
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def _log(msg: str) -> None:
    print(f"[megamoe] {msg}", file=sys.stderr, flush=True)


def _add_shape_args(p: argparse.ArgumentParser) -> None:
    from megamoe.reference import DEFAULT_CONFIG as d
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--intermediate", type=int, default=d.intermediate)
    p.add_argument("--experts", type=int, default=d.num_experts)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--ranks", type=int, default=d.num_ranks)
    p.add_argument("--tokens", type=int, default=d.max_tokens_per_rank, help="tokens per rank")
    p.add_argument("--clamp", type=float, default=None, help="activation clamp c (default: none)")
    p.add_argument("--precise", action="store_true", help="precise SiLU instead of fast math")
    p.add_argument("--distribution", default="uniform")
    p.add_argument("--masked-ratio", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report as JSON to this path")
    p.add_argument("--markdown", help="write the report as a Markdown table to this path")


def _report(args: argparse.Namespace, device: str) -> int:
    from megamoe import reference as ref
    from megamoe.report import to_json, to_markdown, tolerance_report

    cfg = ref.MoEConfig(hidden=args.hidden, intermediate=args.intermediate, num_experts=args.experts,
                        top_k=args.top_k, num_ranks=args.ranks, max_tokens_per_rank=args.tokens,
                        activation_clamp=args.clamp, fast_math=not args.precise)
    _log(f"shape: H={cfg.hidden} I={cfg.intermediate} E={cfg.num_experts} top-{cfg.top_k} "
         f"R={cfg.num_ranks} T={args.tokens}/rank, {'fast' if cfg.fast_math else 'precise'} SiLU, "
         f"clamp={cfg.activation_clamp}, routing={args.distribution}")
    t0 = time.perf_counter()
    inputs = ref.make_inputs(cfg, args.tokens, seed=args.seed, distribution=args.distribution,
                             masked_ratio=args.masked_ratio, device=device)
    weights = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=args.seed, device=device)
    _log(f"inputs quantized in {time.perf_counter() - t0:.2f} s")
    report = tolerance_report(cfg, inputs, weights, log=_log)
    print(f"\nmegamoe reference vs float64 oracle ({report['device']}, reference run "
          f"{report['reference_seconds']:.2f} s):\n")
    print(to_markdown(report))
    if args.json:
        with open(args.json, "w") as f:
            f.write(to_json(report))
        _log(f"wrote {args.json}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(to_markdown(report) + "\n")
        _log(f"wrote {args.markdown}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        _log(f"CUDA GPU found ({name}). The fused kernel is not wired into `megamoe run` yet, "
             "so this runs the reference on the GPU.")
        return _report(args, "cuda")
    _log("No CUDA GPU found: running the CPU reference (megamoe.reference), not the kernel.")
    return _report(args, "cpu")


def cmd_check(args: argparse.Namespace) -> int:
    from megamoe.conformance.suite import check

    report = check(args.dumps, end_to_end=args.end_to_end, progress=_log)
    print(report.text())
    if args.json:
        with open(args.json, "w") as f:
            f.write(report.to_json())
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report.table() + "\n")
    if args.plots:
        from megamoe.conformance.dump import Dump
        from megamoe.conformance.plots import write_plots

        for path in write_plots([Dump.load(p) for p in args.dumps], args.plots):
            _log(f"wrote {path}")
    return 0 if report.ok else 1


def cmd_dump(args: argparse.Namespace) -> int:
    from megamoe import reference as ref
    from megamoe.conformance.dump import reference_dumps

    cfg = ref.MoEConfig(hidden=args.hidden, intermediate=args.intermediate, num_experts=args.experts,
                        top_k=args.top_k, num_ranks=args.ranks, max_tokens_per_rank=args.tokens,
                        activation_clamp=args.clamp, fast_math=not args.precise)
    inputs = ref.make_inputs(cfg, args.tokens, seed=args.seed, distribution=args.distribution,
                             masked_ratio=args.masked_ratio)
    weights = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=args.seed)
    for d in reference_dumps(cfg, inputs, weights):
        path = Path(f"{args.prefix}rank{d.rank}.pt")
        path.parent.mkdir(parents=True, exist_ok=True)
        d.save(path)
        print(path)
    return 0


def cmd_faults(args: argparse.Namespace) -> int:
    from megamoe.conformance.faults import run_catalog

    outcomes = run_catalog(seed=args.seed, progress=_log)
    print("| fault | expected at | caught at | ok |\n|---|---|---|---|")
    for o in outcomes:
        print(f"| {o.fault.name} | {o.fault.point} | {o.report.first_failure} | "
              f"{'yes' if o.caught_where_expected else 'NO'} |")
    caught = sum(o.caught_where_expected for o in outcomes)
    print(f"\n{caught} of {len(outcomes)} faults caught at their stage")
    return 0 if caught == len(outcomes) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megamoe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="the main job: default shape, tolerance report")
    _add_shape_args(p_run)
    p_run.set_defaults(fn=cmd_run)
    p_rep = sub.add_parser("report", help="tolerance report of the reference on a chosen shape")
    _add_shape_args(p_rep)
    p_rep.add_argument("--device", default="cpu")
    p_rep.set_defaults(fn=lambda a: _report(a, a.device))
    p_chk = sub.add_parser("check", help="check the dump files of one call (all ranks)")
    p_chk.add_argument("dumps", nargs="+", help="dump files, one per rank")
    p_chk.add_argument("--end-to-end", action="store_true", help="also report y against the float64 oracle")
    p_chk.add_argument("--json", help="write the results as JSON")
    p_chk.add_argument("--markdown", help="write the per-check table as Markdown")
    p_chk.add_argument("--plots", help="write PNG error plots (D5, D7, end to end) into this folder (needs matplotlib)")
    p_chk.set_defaults(fn=cmd_check)
    p_dump = sub.add_parser("dump", help="write the reference's expected dumps (one file per rank)")
    _add_shape_args(p_dump)
    p_dump.add_argument("--prefix", default="megamoe-dump-", help="file name prefix (default megamoe-dump-)")
    p_dump.set_defaults(fn=cmd_dump)
    p_f = sub.add_parser("faults", help="run the fault catalog")
    p_f.add_argument("--seed", type=int, default=0)
    p_f.set_defaults(fn=cmd_faults)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as exc:  # bad input: MegaMoEInputError and friends
        print(f"megamoe: error: {exc}", file=sys.stderr)
        return 2
