"""Kernel variants of the fused layer side by side, on the same weights and inputs: `python -m bench.ab`.

    python -m bench.ab --variants main,bench/patches/NAME.patch --shape gpt-oss \\
        --tokens 1,8,64 --engine narrow [--rounds 2] [--check] [--predecoded]

A variant is this checkout as it is ("main"), or a copy of its sources with patches applied (`git
apply`, which needs no repository; several patches of one variant joined by "+"). The weights and
inputs are bench.layer's, drawn once and saved; then each variant runs in a process of its own,
whose kernel sources are its tree's (the JIT cache is shared: a cubin's key is its sources' digest),
`--rounds` times in turn, so that clock drift shows as the rounds' spread. Prints one table: per T,
each variant's µs per call (CUDA-graph replay, every round), whether its y equals the first
variant's bit for bit, and the floor (bench.layer's); with --check, each variant's first call (of
the first round) is a debug call through the whole conformance suite, its verdict in the cell. A
variant's process builds its changed kernels on first use, outside the timed calls."""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a variant's process imports: the package's folders (megamoe.reference, .conformance and
# .kernel are top-level folders mapped into the package: pyproject's package-dir) and the benchmarks.
TREE = ("megamoe", "reference", "conformance", "kernel", "bench")
MAPPED = ("reference", "conformance", "kernel")
CHECKED = {None: "", True: " (conforms)", False: " (FAILS the suite)"}


def parse_args(argv=None) -> argparse.Namespace:
    from megamoe.jit import build as jb

    from .layer import LAYER_SHAPES

    ap = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n")[0])
    ap.add_argument("--variants", required=True, help='comma list of "main" or PATCH[+PATCH...] (paths)')
    ap.add_argument("--shape", choices=sorted(LAYER_SHAPES), default="gpt-oss")
    ap.add_argument("--tokens", default="1,8,64", help="T, comma list (default 1,8,64)")
    ap.add_argument("--engine", choices=("auto", *jb.FUSED_ENGINES), default="auto")
    ap.add_argument("--promotion", choices=jb.PROMOTIONS, default="k32")
    ap.add_argument("--predecoded", action="store_true", help="MegaMoE(predecoded=True)")
    ap.add_argument("--rounds", type=int, default=2, help="times each variant runs, in turn (default 2)")
    ap.add_argument("--check", action="store_true", help="a debug call through the conformance suite first")
    ap.add_argument("--out", default=None, metavar="FILE.json", help="also write every number as JSON")
    args = ap.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants:
        ap.error("--variants: at least one")
    for v in args.variants:
        for patch in [] if v == "main" else v.split("+"):
            if not Path(patch).is_file():
                ap.error(f"--variants: {patch!r} is not a file (a patch) nor 'main'")
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens: expected a comma list of integers, got {args.tokens!r}")
    if any(t <= 0 for t in args.tokens) or args.rounds < 1:
        ap.error("--tokens and --rounds: positive")
    return args


def prepare_tree(variant: str, dest: Path) -> Path | None:
    """The sources a variant runs: None for "main" (the installed package, this checkout), else a
    copy of TREE under dest with the variant's patches applied and the package's mapped folders
    linked inside it, so that PYTHONPATH=dest imports all of it from there."""
    if variant == "main":
        return None
    dest.mkdir(parents=True)
    for name in TREE:
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in MAPPED:
        (dest / "megamoe" / name).symlink_to(Path("..") / name)
    for patch in variant.split("+"):
        path = str(Path(patch).resolve())
        if shutil.which("git"):
            # The patches' other files (tests, docs) are not in the copy: only TREE's are applied.
            cmd = ["git", "apply", *(f"--include={name}/*" for name in TREE), path]
        elif shutil.which("patch"):
            cmd = ["patch", "-p1", "--batch", "--forward", "--silent", "-i", path]
        else:
            raise RuntimeError("bench.ab: applying a patch needs git or patch, and this machine has neither")
        run = subprocess.run(cmd, cwd=dest, capture_output=True, text=True)
        if run.returncode:
            why = (run.stderr.strip() or run.stdout.strip() or f"exit {run.returncode}").splitlines()[0]
            raise RuntimeError(f"{patch}: {cmd[0]} apply failed: {why}")
    return dest


def child(data: str, out: str) -> None:
    """In a variant's process: the layer at each T, timed (and checked), y saved."""
    import torch

    from megamoe.conformance.suite import check
    from megamoe.kernel import KERNEL_DIR
    from megamoe.moe import MegaMoE

    from .gemm import graph_us
    from .layer import launches_for, layer_config

    spec = json.loads(Path(out).with_suffix(".args").read_text())
    tree = os.environ.get("BENCH_AB_TREE")
    if tree and not str(KERNEL_DIR).startswith(tree):
        raise RuntimeError(f"the variant's kernels are {KERNEL_DIR}, not its tree's ({tree})")
    saved = torch.load(data, weights_only=False)  # the reference's dataclasses: our own file
    weights = saved["weights"].to("cuda")
    rows = []
    for tokens in spec["tokens"]:
        cfg = layer_config(spec["shape"], tokens)
        layer = MegaMoE(cfg, weights, promotion=spec["promotion"], engine=spec["engine"], predecoded=spec["predecoded"])
        inp = saved["inputs"][str(tokens)].to("cuda")
        args = (inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
        ok = None
        if spec["check"]:
            _, dumps = layer(*args, debug=True)
            ok = check(dumps).ok
        call = functools.partial(layer, *args, check_inputs=False)
        us = graph_us(call, launches=launches_for(tokens))
        y = call().cpu()
        rows.append(dict(tokens=tokens, us=us, ok=ok, engine=layer.engine_for(tokens)))
        torch.save(y, Path(out).with_suffix(f".y{tokens}"))
        del layer
        torch.cuda.empty_cache()
    Path(out).write_text(json.dumps(rows))


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench.ab needs a CUDA GPU (it times the layer on the device)")
    from megamoe import reference as ref

    from .gemm import card
    from .layer import LAYER_TOP_K, SEED, layer_config, layer_floor, progress, shape_weights

    work = Path(tempfile.mkdtemp(prefix="megamoe-ab-"))
    weights = shape_weights(args.shape).to("cpu")
    torch.cuda.empty_cache()  # the variants' processes get the device's memory
    inputs, floors, lim = {}, {}, card()
    for tokens in args.tokens:
        cfg = layer_config(args.shape, tokens)
        inputs[str(tokens)] = ref.make_inputs(cfg, tokens, seed=SEED, distribution="uniform")[0]  # bench.layer's
        counts = ref.send_counts(inputs[str(tokens)].topk_idx, cfg.num_experts)
        floors[tokens] = layer_floor(
            cfg.hidden,
            cfg.intermediate,
            tokens,
            LAYER_TOP_K[args.shape],
            int((counts > 0).sum()),
            int(counts.sum()),
            lim,
        ).us
    data = work / "data.pt"
    torch.save(dict(weights=weights, inputs=inputs), data)
    trees = [prepare_tree(v, work / f"tree{i}") for i, v in enumerate(args.variants)]
    spec = dict(tokens=args.tokens, shape=args.shape, engine=args.engine, promotion=args.promotion)
    spec.update(predecoded=args.predecoded, check=args.check)
    runs: dict[int, list[list[dict] | str]] = {i: [] for i in range(len(args.variants))}
    for r in range(args.rounds):
        for i, (variant, tree) in enumerate(zip(args.variants, trees)):
            progress(f"round {r + 1}: {variant}")
            out = work / f"v{i}_r{r}.json"
            # The conformance check in the first round only: a variant's bits do not change between rounds.
            out.with_suffix(".args").write_text(json.dumps({**spec, "check": args.check and r == 0}))
            env = dict(os.environ)
            if tree is not None:
                env.update(PYTHONPATH=f"{tree}{os.pathsep}{env.get('PYTHONPATH', '')}", BENCH_AB_TREE=str(tree))
            run = subprocess.run(
                [sys.executable, "-m", "bench.ab", "--child", str(data), str(out)],
                env=env,
                cwd=tree or ROOT,
                capture_output=True,
                text=True,
            )
            if run.returncode:
                lines = (run.stderr.strip() or run.stdout.strip() or "no output").splitlines()
                runs[i].append(f"exit {run.returncode}: {lines[-1]}")
                progress(f"round {r + 1}: {variant}: {runs[i][-1]}")
            else:
                runs[i].append(json.loads(out.read_text()))
                # Each variant's numbers as they come: a run cut short still tells what it measured.
                cells = [f"T {c['tokens']} {c['us']:.1f} us" + CHECKED[c["ok"]] for c in runs[i][-1]]
                progress(f"round {r + 1}: {variant}: " + ", ".join(cells))
    print(format_table(args, runs, floors, work, lim.name))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(variants=args.variants, runs=runs, floors=floors), indent=1))


def format_table(args, runs, floors, work: Path, card_name: str) -> str:
    """One row per T: each variant's µs of every round (its first round's y against the first
    variant's, = or !=; its conformance with --check), then the floor (at card_name's limits)."""
    import torch

    from .layer import markdown_table

    head = ["T", *args.variants, "floor"]
    lines = []
    for j, tokens in enumerate(args.tokens):
        cells = [str(tokens)]
        first_y = None
        for i in range(len(args.variants)):
            good = [r for r in runs[i] if not isinstance(r, str)]
            errors = [r for r in runs[i] if isinstance(r, str)]
            if not good:
                cells.append(errors[0][:60])
                continue
            us = " / ".join(f"{r[j]['us']:.1f}" for r in good)
            y = torch.load(work / f"v{i}_r{runs[i].index(good[0])}.y{tokens}")
            first_y = y if first_y is None else first_y
            same = "=" if torch.equal(y.view(torch.int16), first_y.view(torch.int16)) else "!="
            ok = good[0][j]["ok"]
            cells.append(f"{us} {same}" + ("" if ok is None else " ok" if ok else " NONCONFORMANT"))
        cells.append(f"{floors[tokens]:.1f}")
        lines.append(cells)
    out = markdown_table(head, lines)
    legend = (
        f"{args.shape}, engine {args.engine}, promotion {args.promotion}{', predecoded' if args.predecoded else ''}: "
        "us per call (CUDA-graph replay), one value a round; = / != : y against the first variant's, bit for bit; "
        f"floor at the {card_name}'s limits"
    )
    return legend + "\n" + "\n".join(out)


if __name__ == "__main__":
    main()
