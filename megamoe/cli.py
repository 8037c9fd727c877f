"""The `megamoe` command.

    megamoe run      the main job: the MoE layer on the default shape and its tolerance report
                     (a CPU-only machine runs the reference and says so; on a GPU,
                     --processes runs the kernel on --ranks ranks as processes)
    megamoe report   the same report with explicit shape options and JSON / Markdown files
    megamoe check    check recorded dump files stage by stage (exit 1 on any failure)
    megamoe dump     write the reference's expected dumps of a shape to files
    megamoe faults   run the fault catalog: every planted fault must be caught at its stage

Exit codes: 0 success, 1 a check or a fault not caught where expected, 2 a bad option or input
(one line on stderr saying which and why, before any work).

Every command takes --threads N, torch's CPU threads (the environment's MEGAMOE_THREADS=N does the
same; megamoe.reference.threads); `megamoe --version` prints the version.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

import torch

from megamoe import __version__

# MoEConfig's field names, as the options that set them are spelled on the command line.
CONFIG_OPTIONS = {
    "hidden": "--hidden",
    "intermediate": "--intermediate",
    "num_experts": "--experts",
    "top_k": "--top-k",
    "num_ranks": "--ranks",
    "max_tokens_per_rank": "--tokens",
    "activation_clamp": "--clamp",
    "masked_ratio": "--masked-ratio",
}
SEED_LIMIT = 2**32  # seeds become seed·1000 + rank in a torch.Generator: stay far from its 64-bit range
# Pool rows, tokens and slots are int32 in the dumps (D3, D4.pool_meta, D4.expert_offsets) and in the
# kernel's workspace (megamoe/jit/contract.py WORKSPACE).
INT32_MAX = 2**31 - 1


def _log(msg: str) -> None:
    print(f"[megamoe] {msg}", file=sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints the whole usage first; one line says enough
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---- option types: argparse prints a bad value as "megamoe CMD: error: argument --x: <why>" ----


def _int_at_least(low: int, multiple: int = 1, below: int | None = None):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low or v % multiple or (below is not None and v >= below):
            what = f"a multiple of {multiple} that is at least {low}" if multiple > 1 else f"an integer >= {low}"
            raise argparse.ArgumentTypeError(f"expected {what}{f' and below {below}' if below else ''}, got {v}")
        return v

    return parse


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return v


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text}")
    return v


def _writable_folder(folder: Path, what: str) -> None:
    """Refuse (one line, at parse time, before any work) a folder that an output cannot go into. A
    missing folder is never made silently: a typo in its path would scatter results elsewhere."""
    if not folder.exists():
        raise argparse.ArgumentTypeError(f"{what} {folder} does not exist; make it first")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{what} {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{what} {folder} is not writable")


def _output_file(text: str) -> Path:
    """A file to write, in a folder that exists; an existing folder in its place is refused."""
    p = Path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; expected a file name")
    _writable_folder(p.parent, "the folder")
    return p


def _device(text: str) -> str:
    if text == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("cuda needs a CUDA GPU, and torch sees none on this machine")
    return text


def _plots_folder(text: str) -> Path:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise argparse.ArgumentTypeError("plots need matplotlib: pip install 'megamoe[plots]'") from None
    p = Path(text)
    if p.exists() and not p.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; expected a folder")
    _writable_folder(p if p.exists() else p.parent, "the folder")  # DIR itself is made, not its parents
    return p


def _dump_prefix(text: str) -> str:
    """PREFIXrank<r>.pt: a prefix ending in / is a folder, made if missing (not its parents); else the
    files go into the folder the prefix names, which must exist."""
    folder = Path(text) if text.endswith("/") else Path(text).parent
    _writable_folder(folder.parent if text.endswith("/") and not folder.exists() else folder, "the folder")
    return text


def _threads(text: str) -> int:
    from megamoe.reference.threads import parse_threads

    try:
        return parse_threads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _write(path: Path, text: str) -> None:
    path.write_text(text)  # its folder was checked when the option was parsed
    _log(f"wrote {path}")


def _add_shape_args(p: argparse.ArgumentParser) -> None:
    from megamoe.reference import DEFAULT_CONFIG as d
    from megamoe.reference import DISTRIBUTIONS

    p.add_argument(
        "--hidden",
        type=_int_at_least(32, 32),
        default=d.hidden,
        metavar="H",
        help="hidden size H, a multiple of 32 (the fast mode: of 512) (default: %(default)s)",
    )
    p.add_argument(
        "--intermediate",
        type=_int_at_least(32, 32),
        default=d.intermediate,
        metavar="I",
        help="intermediate size I per expert, a multiple of 32 (the fast mode: of 512) (default: %(default)s)",
    )
    p.add_argument(
        "--experts",
        type=_int_at_least(1),
        default=d.num_experts,
        metavar="E",
        help="experts E in all, a multiple of --ranks (default: %(default)s)",
    )
    p.add_argument(
        "--top-k",
        type=_int_at_least(1),
        default=d.top_k,
        metavar="K",
        help="experts per token K, at most E (default: %(default)s)",
    )
    p.add_argument(
        "--ranks",
        type=_int_at_least(1),
        default=d.num_ranks,
        metavar="R",
        help="ranks R, run in this one process (default: %(default)s)",
    )
    p.add_argument(
        "--tokens",
        type=_int_at_least(0),
        default=d.max_tokens_per_rank,
        metavar="T",
        help="tokens per rank T (default: %(default)s)",
    )
    p.add_argument(
        "--clamp",
        type=_positive_float,
        default=None,
        metavar="C",
        help="activation clamp c > 0 of the SwiGLU (default: none, no clamp)",
    )
    p.add_argument(
        "--precise",
        action="store_true",
        help="the precise SiLU table instead of the fast-math one (default: off, fast math)",
    )
    p.add_argument(
        "--distribution",
        choices=DISTRIBUTIONS,
        default="uniform",
        help="routing distribution of the test inputs (choices: %(choices)s; default: %(default)s)",
    )
    p.add_argument(
        "--masked-ratio",
        type=_fraction,
        default=0.0,
        metavar="F",
        help="fraction in [0, 1] of the top-k slots set to -1, no expert (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=_int_at_least(0, below=SEED_LIMIT),
        default=0,
        help="seed of the inputs and weights (default: %(default)s)",
    )


# gpt-oss's MoE layers (SPEC §8): H = I = 2880, top-4, MXFP4 experts with biases.
GPT_OSS_MODELS = {"gpt-oss-20b": 32, "gpt-oss-120b": 128}  # experts per layer
GPT_OSS_SHAPE = dict(hidden=2880, intermediate=2880, top_k=4)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        choices=tuple(GPT_OSS_MODELS),
        help="one MoE layer of this model (choices: %(choices)s) at its real shape (H = I = 2880, its experts, "
        "top-4, SPEC §8's activation), random weights and biases written as a gpt-oss checkpoint and loaded "
        "back; --hidden, --intermediate, --experts and --top-k are the model's (default: none, the shape options)",
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        metavar="PATH",
        help="with --layer: that layer's experts from a gpt-oss checkpoint (a .safetensors file or a folder "
        "of shards; needs the 'checkpoints' extra) at the file's shape and gpt-oss's top-4, instead of random "
        "weights (default: none)",
    )
    p.add_argument(
        "--layer", type=_int_at_least(0), metavar="N", help="the checkpoint's layer, with --checkpoint (default: none)"
    )


def _add_report_outputs(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        type=_output_file,
        metavar="FILE",
        help="also write the report as JSON to FILE, in a folder that exists (default: none, not written)",
    )
    p.add_argument(
        "--markdown",
        type=_output_file,
        metavar="FILE",
        help="also write the report as a Markdown table to FILE, in a folder that exists (default: none, not written)",
    )


def _config(args: argparse.Namespace):
    from megamoe import reference as ref

    shape = dict(hidden=args.hidden, intermediate=args.intermediate, num_experts=args.experts, top_k=args.top_k)
    gpt_oss = {}
    if getattr(args, "model", None):
        shape = dict(GPT_OSS_SHAPE, num_experts=GPT_OSS_MODELS[args.model])
    elif getattr(args, "checkpoint", None):
        from megamoe.checkpoints import gpt_oss_layer_shape

        e, h, i = gpt_oss_layer_shape(args.checkpoint, args.layer)  # the file's shape; top-k is gpt-oss's
        shape = dict(hidden=h, intermediate=i, num_experts=e, top_k=GPT_OSS_SHAPE["top_k"])
    if getattr(args, "model", None) or getattr(args, "checkpoint", None):
        if args.clamp is not None:
            raise ValueError("argument --clamp: gpt-oss's activation clamps at its own limit (SPEC §8), not --clamp")
        gpt_oss = dict(activation="swiglu_oai")
    cfg = ref.MoEConfig(
        **shape,
        num_ranks=args.ranks,
        max_tokens_per_rank=args.tokens,
        activation_clamp=args.clamp,
        fast_math=not args.precise,
        **gpt_oss,
    )
    # The routing options against the shape, by the generator's own checks (0 tokens: no work).
    ref.make_routing(0, cfg.num_experts, cfg.top_k, distribution=args.distribution, masked_ratio=args.masked_ratio)
    return cfg


def _available_memory(device: str) -> int | None:
    """Bytes a new allocation may take on `device` (the GPU's free memory; on the host the kernel's
    MemAvailable, capped by a cgroup v2 memory limit), None where unknown."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    free = None
    try:
        meminfo = Path("/proc/meminfo").read_text()
        free = next(int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:"))
    except (OSError, ValueError, IndexError, StopIteration):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
            free = left if free is None else min(free, left)
    except (OSError, ValueError):
        pass
    return free


def _too_large(cfg, routed: float, available: int | None) -> str | None:
    """Why a call of this shape cannot run here, in words; None when it may."""
    from megamoe.conformance.dump import call_dump_bytes
    from megamoe.jit.contract import workspace_dims

    rows = workspace_dims(cfg)["P"]
    if rows > INT32_MAX:
        return f"a rank's pool of up to {rows} rows (R*T*K slots, each expert aligned) overflows the int32 row indices"
    need = call_dump_bytes(cfg, routed)
    if available is not None and need > available:
        return f"the call's dumps alone take about {need / 1e9:,.1f} GB, more than the {available / 1e9:,.1f} GB free"
    return None


def _check_sizes(args: argparse.Namespace, cfg, device: str) -> None:
    """Refuse, before any work, a shape whose indices overflow int32 or whose dumps alone would not fit
    in memory (an allocator's traceback minutes into the run otherwise), naming the largest --tokens
    that fits."""
    available, routed = _available_memory(device), 1.0 - args.masked_ratio

    def why(tokens: int) -> str | None:
        return _too_large(dataclasses.replace(cfg, max_tokens_per_rank=tokens), routed, available)

    if why(cfg.max_tokens_per_rank) is None:
        return
    if why(0) is not None:
        raise ValueError(f"argument --hidden/--intermediate/--experts: this shape cannot run here at all: {why(0)}")
    lo, hi = 0, cfg.max_tokens_per_rank  # lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if why(mid) is None else (lo, mid)
    raise ValueError(
        f"argument --tokens: expected at most {lo} tokens per rank for this shape (beyond: {why(hi)}), "
        f"got {args.tokens}"
    )


def _check_options(args: argparse.Namespace) -> None:
    """What an option can be wrong about that its parser could not see alone (the shape against the
    config's checks and against this machine), before any work and before the first progress line,
    so that a bad option is the one line of its error."""
    if getattr(args, "model", None) and getattr(args, "checkpoint", None):
        raise ValueError("argument --checkpoint: a checkpoint's layer or a --model's random one, not both")
    if getattr(args, "checkpoint", None) is not None:
        if args.layer is None:
            raise ValueError("argument --checkpoint: needs --layer N, the layer whose experts to load")
        if not args.checkpoint.exists():
            raise ValueError(f"argument --checkpoint: expected a .safetensors file or a folder, got {args.checkpoint}")
    elif getattr(args, "layer", None) is not None:
        raise ValueError("argument --layer: a layer of --checkpoint, which is not given")
    if hasattr(args, "hidden"):
        device = getattr(args, "device", "cuda" if args.command == "run" and torch.cuda.is_available() else "cpu")
        cfg = _config(args)
        _check_sizes(args, cfg, device)
        if cfg.activation == "swiglu_oai":
            from megamoe import reference as ref

            ref.glu_table(cfg.fast_math)  # made on a GPU (SPEC §8): a missing table is said before any work


def _inputs(args: argparse.Namespace, cfg, device: str = "cpu"):
    from megamoe import reference as ref

    inputs = ref.make_inputs(
        cfg, args.tokens, seed=args.seed, distribution=args.distribution, masked_ratio=args.masked_ratio, device=device
    )
    if getattr(args, "checkpoint", None):
        from megamoe.checkpoints import load_gpt_oss_experts

        _log(f"loading layer {args.layer}'s experts from {args.checkpoint}")
        return inputs, load_gpt_oss_experts(args.checkpoint, args.layer, device=device)
    weights = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=args.seed, device=device)
    if getattr(args, "model", None):
        weights = _through_a_checkpoint(weights, cfg, args.seed, device)
    return inputs, weights


def _through_a_checkpoint(weights, cfg, seed: int, device: str):
    """Random biases beside the random weights, written as a gpt-oss checkpoint (transformers'
    naming) and loaded back: the loader is part of what --model runs."""
    import tempfile

    from megamoe import reference as ref
    from megamoe.checkpoints import load_gpt_oss_experts, save_gpt_oss_experts

    weights.b1, weights.b2 = ref.random_biases(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=seed, device=device)
    with tempfile.TemporaryDirectory(prefix="megamoe-gpt-oss-") as tmp:
        path = Path(tmp) / "model.safetensors"
        save_gpt_oss_experts(path, {0: weights})
        _log(
            f"random weights and biases written as a gpt-oss checkpoint ({path.stat().st_size / 2**20:.0f} MiB), loading"
        )
        return load_gpt_oss_experts(path, 0, device=device)


def _activation_words(cfg) -> str:
    """The activation in the shape line: "fast SiLU, clamp=None" or "precise swiglu_oai (alpha 1.702,
    limit 7.0)"."""
    mode = "fast" if cfg.fast_math else "precise"
    if cfg.activation == "swiglu_oai":
        return f"{mode} swiglu_oai (alpha {cfg.alpha}, limit {cfg.limit})"
    return f"{mode} SiLU, clamp={cfg.activation_clamp}"


def _report(args: argparse.Namespace, device: str) -> int:
    from megamoe.report import tolerance_report

    cfg = _config(args)
    _log(
        f"shape: H={cfg.hidden} I={cfg.intermediate} E={cfg.num_experts} top-{cfg.top_k} "
        f"R={cfg.num_ranks} T={args.tokens}/rank, {_activation_words(cfg)}, routing={args.distribution}"
    )
    t0 = time.perf_counter()
    inputs, weights = _inputs(args, cfg, device)
    _log(f"inputs and weights made in {time.perf_counter() - t0:.2f} s")
    report = tolerance_report(cfg, inputs, weights, log=_log)
    _print_report(args, report, f"reference run {report['reference_seconds']:.2f} s")
    return 0


def _print_report(args: argparse.Namespace, report: dict, note: str) -> None:
    """A tolerance report (megamoe.report) as its table, and as the files --json / --markdown name."""
    from megamoe.report import to_json, to_markdown

    print(f"\nmegamoe {report['source']} vs float64 oracle ({report['device']}, {note}):\n")
    print(to_markdown(report))
    if args.json:
        _write(args.json, to_json(report))
    if args.markdown:
        _write(args.markdown, to_markdown(report) + "\n")


def cmd_run(args: argparse.Namespace) -> int:
    if torch.cuda.is_available():
        return _run_expert_parallel(args) if args.processes else _run_fused(args)
    if args.processes:
        raise ValueError("argument --processes: runs the kernel on several ranks, which needs a CUDA GPU")
    _log("No CUDA GPU found: running the CPU reference (megamoe.reference), not the kernel.")
    return _report(args, "cpu")


def _run_fused(args: argparse.Namespace) -> int:
    """On a GPU: the fused kernel (megamoe.MegaMoE) on one rank holding the whole global batch,
    every dump point checked by the conformance suite, then its CUDA-graph time beside the
    reference's."""
    import dataclasses

    from megamoe import reference as ref
    from megamoe.conformance.suite import check
    from megamoe.moe import MegaMoE
    from megamoe.report import kernel_report

    cfg = _config(args)
    tokens = args.tokens * cfg.num_ranks
    cfg = dataclasses.replace(cfg, num_ranks=1, max_tokens_per_rank=tokens)
    _log(
        f"CUDA GPU found ({torch.cuda.get_device_name()}): the fused kernel on one rank holding the global "
        f"batch of {tokens} tokens (--processes: {args.ranks} ranks as processes); "
        f"H={cfg.hidden} I={cfg.intermediate} E={cfg.num_experts} top-{cfg.top_k}, "
        f"{_activation_words(cfg)}, routing={args.distribution}"
    )
    inputs, weights = _inputs(args, cfg, "cuda")
    inp = inputs[0]
    t0 = time.perf_counter()
    layer = MegaMoE(cfg, weights)
    call = (inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    _, dumps = layer(*call, debug=True)
    _log(f"kernel built, loaded and run (debug build) in {time.perf_counter() - t0:.1f} s; checking every dump point")
    # y against the float64 oracle: the kernel's report below (its end-to-end rows), one oracle run
    report = check(dumps, progress=_log)
    print(report.text())
    _print_report(args, kernel_report(dumps, log=_log), "the kernel's debug build")
    kernel_us = _graph_time_us(lambda: layer(*call))
    t0 = time.perf_counter()
    ref.run_reference(cfg, inputs, weights)
    torch.cuda.synchronize()
    ref_us = (time.perf_counter() - t0) * 1e6
    print(
        f"\nfused kernel: {kernel_us:.1f} us per call (CUDA-graph replay); "
        f"reference on the same GPU: {ref_us / 1e3:.1f} ms ({ref_us / kernel_us:.0f}x)"
    )
    return 0 if report.ok else 1


def _run_expert_parallel(args: argparse.Namespace) -> int:
    """On a GPU, --processes: the fused kernel on R ranks run as R processes (expert parallelism
    through symmetric memory; all on one GPU when there is one), every rank's dump points checked
    together by the suite, then each rank's CUDA-graph time."""
    from megamoe import multirank
    from megamoe.conformance.dump import with_weights
    from megamoe.conformance.suite import check
    from megamoe.report import kernel_report

    cfg = _config(args)
    gpus = torch.cuda.device_count()
    _log(
        f"CUDA GPU found ({torch.cuda.get_device_name()}): the fused kernel on {cfg.num_ranks} ranks, one process "
        f"each on {min(gpus, cfg.num_ranks)} GPU(s), {args.tokens} tokens per rank; "
        f"H={cfg.hidden} I={cfg.intermediate} E={cfg.num_experts} top-{cfg.top_k}, routing={args.distribution}"
    )
    t0 = time.perf_counter()
    per_rank = multirank.spawn(_expert_parallel_rank, cfg.num_ranks, args=(args,))
    _log(f"{cfg.num_ranks} ranks started, built and run in {time.perf_counter() - t0:.1f} s; checking every dump point")
    # Weights put back once (random ones are regenerated from their seed) for the suite and the
    # report; y against the float64 oracle: the report's end-to-end rows, one oracle run.
    dumps = with_weights([dump for dump, _ in per_rank], progress=_log)
    report = check(dumps, progress=_log)
    print(report.text())
    _print_report(args, kernel_report(dumps, log=_log), f"the kernel's debug build, {cfg.num_ranks} ranks")
    times = ", ".join(f"rank {r}: {us:.1f}" for r, (_, us) in enumerate(per_rank))
    shared = " (ranks time-slice one GPU: not a speed figure)" if gpus < cfg.num_ranks else ""
    print(f"\nfused kernel, us per call (CUDA-graph replay): {times}{shared}")
    return 0 if report.ok else 1


def _expert_parallel_rank(rank: int, ranks: int, args: argparse.Namespace):
    """One rank of `megamoe run --processes` (a spawned process): its dumps and its time."""
    from megamoe import multirank
    from megamoe.moe import MegaMoE

    cfg = _config(args)
    inputs, weights = _inputs(args, cfg, "cuda")
    inp = inputs[rank]
    layer = MegaMoE(cfg, weights, group=multirank.group())
    call = (inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    with layer.named_failures():  # a wait that timed out is named in the rank's error
        _, dumps = layer(*call, debug=True)
        # Random weights travel as their seed; a gpt-oss layer's (a checkpoint's, or --model's with
        # their biases) as they are.
        dump = dumps[0] if args.model or args.checkpoint else dumps[0].without_weights(args.seed)
        return dump, _graph_time_us(lambda: layer(*call), barrier=multirank.group())


def _graph_time_us(fn, replays: int = 20, barrier=None) -> float:
    """Mean time of one call of `fn`, captured once in a CUDA graph and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    if barrier is not None:  # several ranks: start the timed replays together
        from megamoe import ranks

        torch.cuda.synchronize()
        ranks.barrier(barrier)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def cmd_check(args: argparse.Namespace) -> int:
    from megamoe.conformance.dump import Dump, with_weights
    from megamoe.conformance.suite import all_ranks, check

    # A file that is no dump, a missing rank or weights that do not match stop here, in one line.
    dumps = with_weights(all_ranks([Dump.load(p) for p in args.dumps]), progress=_log)
    report = check(dumps, end_to_end=args.end_to_end, progress=_log)
    print(report.text())
    if args.json:
        _write(args.json, report.to_json())
    if args.markdown:
        _write(args.markdown, report.table() + "\n")
    if args.plots:
        from megamoe.conformance.plots import write_plots

        for path in write_plots(dumps, args.plots):
            _log(f"wrote {path}")
    return 0 if report.ok else 1


def cmd_dump(args: argparse.Namespace) -> int:
    from megamoe.conformance.dump import reference_dumps

    cfg = _config(args)
    _log(f"making the inputs and the weights of {cfg.num_experts} experts (seed {args.seed})")
    t0 = time.perf_counter()
    inputs, weights = _inputs(args, cfg)
    _log(f"made in {time.perf_counter() - t0:.1f} s; running the reference")
    for d in reference_dumps(cfg, inputs, weights):
        path = Path(f"{args.prefix}rank{d.rank}.pt")
        path.parent.mkdir(exist_ok=True)  # a prefix's own folder (its parent was checked by _dump_prefix)
        (d.without_weights(seed=args.seed) if args.no_weights else d).save(path)
        print(path)
    return 0


def cmd_faults(args: argparse.Namespace) -> int:
    from megamoe.conformance.faults import run_catalog

    outcomes = run_catalog(seed=args.seed, progress=_log)
    print("| fault | expected at | caught at | ok |\n|---|---|---|---|")
    for o in outcomes:
        print(
            f"| {o.fault.name} | {o.fault.point} | {o.report.first_failure} | "
            f"{'yes' if o.caught_where_expected else 'NO'} |"
        )
    caught = sum(o.caught_where_expected for o in outcomes)
    print(f"\n{caught} of {len(outcomes)} faults caught at their stage")
    return 0 if caught == len(outcomes) else 1


def _add_threads_arg(p: argparse.ArgumentParser) -> None:
    from megamoe.reference.threads import THREADS_ENV

    p.add_argument(
        "--threads",
        type=_threads,
        metavar="N",
        help=f"torch CPU threads of the reference (the same as {THREADS_ENV}=N); fewer than the cores "
        "can be much faster on a machine busy with other work (default: none given: "
        f"${THREADS_ENV}, else the cores this process may use)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="megamoe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"megamoe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p_run = sub.add_parser("run", help="the main job: default shape, tolerance report")
    _add_shape_args(p_run)
    _add_model_args(p_run)
    _add_report_outputs(p_run)
    p_run.add_argument(
        "--processes",
        action="store_true",
        help="on a GPU: run the kernel on --ranks ranks, one process each (expert parallelism through "
        "symmetric memory; ranks share the GPU when there is one) (default: off, one rank holds every token)",
    )
    _add_threads_arg(p_run)
    p_run.set_defaults(fn=cmd_run)

    p_rep = sub.add_parser("report", help="tolerance report of the reference on a chosen shape")
    _add_shape_args(p_rep)
    _add_model_args(p_rep)
    _add_report_outputs(p_rep)
    p_rep.add_argument(
        "--device",
        type=_device,
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the reference runs (choices: %(choices)s; default: %(default)s)",
    )
    _add_threads_arg(p_rep)
    p_rep.set_defaults(fn=lambda a: _report(a, a.device))

    p_chk = sub.add_parser("check", help="check the dump files of one call (all ranks)")
    p_chk.add_argument("dumps", nargs="+", metavar="DUMP", help="dump files, one per rank, all ranks of one call")
    p_chk.add_argument(
        "--end-to-end", action="store_true", help="also report y against the float64 oracle (default: off)"
    )
    p_chk.add_argument(
        "--json",
        type=_output_file,
        metavar="FILE",
        help="also write the results as JSON to FILE, in a folder that exists (default: none, not written)",
    )
    p_chk.add_argument(
        "--markdown",
        type=_output_file,
        metavar="FILE",
        help="also write the per-check table as Markdown to FILE, in a folder that exists (default: none, not written)",
    )
    p_chk.add_argument(
        "--plots",
        type=_plots_folder,
        metavar="DIR",
        help="write PNG error plots (D5, D7, end to end) into DIR, made if missing (its parent must "
        "exist); needs matplotlib (default: none, no plots)",
    )
    _add_threads_arg(p_chk)
    p_chk.set_defaults(fn=cmd_check)

    p_dump = sub.add_parser("dump", help="write the reference's expected dumps (one file per rank)")
    _add_shape_args(p_dump)
    p_dump.add_argument(
        "--prefix",
        type=_dump_prefix,
        default="megamoe-dumps/",
        help="files are PREFIXrank0.pt, PREFIXrank1.pt, ...; a prefix ending in / is a folder, "
        "made if missing (its parent must exist) (default: %(default)s, which git ignores)",
    )
    p_dump.add_argument(
        "--no-weights",
        action="store_true",
        help="leave the weights out of the files (most of their bytes); `megamoe check` "
        "regenerates them from --seed and verifies their SHA-256 (default: off, every "
        "file holds its rank's weights)",
    )
    _add_threads_arg(p_dump)
    p_dump.set_defaults(fn=cmd_dump)

    p_f = sub.add_parser("faults", help="run the fault catalog")
    p_f.add_argument(
        "--seed",
        type=_int_at_least(0, below=SEED_LIMIT),
        default=0,
        help="seed of the fault scenarios (default: %(default)s)",
    )
    _add_threads_arg(p_f)
    p_f.set_defaults(fn=cmd_faults)
    return parser


def _in_option_words(message: str) -> str:
    """'argument 'num_experts': ...' (the library's words) -> 'argument --experts: ...'."""
    for field, option in CONFIG_OPTIONS.items():
        message = message.replace(f"argument '{field}'", f"argument {option}").replace(f"{field} =", f"{option} =")
    return message


def main(argv: list[str] | None = None) -> int:
    try:
        # Imported here, not at the top of this file: importing it imports megamoe.reference, which
        # limits the threads on import, so a bad MEGAMOE_THREADS raises here, where it is one line.
        from megamoe.reference import threads

        threads.limit_torch_threads()  # threads says why; before parsing, which may end the run (--help)
    except ValueError as exc:  # a bad MEGAMOE_THREADS
        print(f"megamoe: error: {exc}", file=sys.stderr)
        return 2
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a bad option (its line is printed): the code, not a raise
        return int(exc.code or 0)
    if args.threads is not None:
        # Through the variable, so that `import megamoe.reference` (which limits the threads again)
        # and the ranks that --processes spawns keep the count too.
        os.environ[threads.THREADS_ENV] = str(args.threads)
        threads.limit_torch_threads()
    try:
        _check_options(args)
        return args.fn(args)
    except (ValueError, OSError) as exc:
        # Bad input: MegaMoEInputError, a file that is no dump (DumpFormatError), a file that cannot
        # be read or written. One line, exit code 2.
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"megamoe {args.command}: error: {_in_option_words(message)}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as exc:
        # _check_sizes refuses what cannot fit from a lower bound; an allocation that fails anyway
        # (the reference's temporaries, memory others took meanwhile) is one line too, not a traceback.
        # torch says so in a RuntimeError (torch.OutOfMemoryError on a GPU, the CPU allocator's words).
        if not isinstance(exc, (MemoryError, torch.OutOfMemoryError)) and "can't allocate memory" not in str(exc):
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"megamoe {args.command}: error: out of memory, choose a smaller shape: {message}", file=sys.stderr)
        return 2
