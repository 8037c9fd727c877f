"""Did a source change leave the machine code alone? `python -m bench.sass_identity`.

    python -m bench.sass_identity save before.json     # every kernel spec's SASS fingerprint
    ... change the sources (a rename, a comment, generated code) ...
    python -m bench.sass_identity compare before.json  # the specs whose SASS differs; exit 1 if any

No GPU: nvcc builds every specialisation the tests and benchmarks launch (megamoe.heuristics.used_specs
and fused_specs; cached builds are reused) and nvdisasm reads them. A fingerprint is the
sha256 of the SASS without its instruction addresses and branch labels, which move when code does
not change; every instruction, immediate and parameter offset counts.
A restructuring whose SASS is identical needs no new GPU run to show it is as fast."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

# What moves when code is only renamed or reordered in the source: instruction addresses and the
# branch labels made from them. Immediates and constant-bank operands (parameter offsets) are kept:
# a planted change of one immediate (exp2i's -126 to -125) must show.
_NORMALISE = [
    (re.compile(r"/\*[0-9a-f]{4,}\*/"), ""),  # addresses
    (re.compile(r"\.L_x_\d+"), "L"),  # branch labels
    # a static function's mangled name carries a hash of its file's text (_INTERNAL_175c6bf0_...):
    # it changes with any edit of the file, a comment's too
    (re.compile(r"_INTERNAL_[0-9a-f]{8}_"), "_INTERNAL_"),
]


def specs() -> list:
    from megamoe import heuristics

    return heuristics.used_specs() + heuristics.fused_specs()


def fingerprint(sass: str) -> tuple[str, int]:
    """sha256 of the normalised instructions and their count."""
    lines = []
    for ln in sass.splitlines():
        for pattern, repl in _NORMALISE:
            ln = pattern.sub(repl, ln)
        ln = ln.strip()
        if ln and not ln.startswith(("//", ".")):
            lines.append(ln)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest(), len(lines)


def fingerprints(disasm: str, jobs: int = 3) -> dict[str, tuple[str, int]]:
    from megamoe.jit import build as jb

    todo = specs()
    with ThreadPoolExecutor(jobs) as ex:
        built = list(ex.map(jb.build, todo))
    out = {}
    for spec, b in zip(todo, built):
        sass = subprocess.run([disasm, "-c", str(b.cubin)], capture_output=True, text=True, check=True).stdout
        out[spec.name] = fingerprint(sass)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    from bench.sass_stage import NVDISASM_HOW, nvdisasm

    p = argparse.ArgumentParser(prog="python -m bench.sass_identity", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("save", "compare"))
    p.add_argument("file", help="the fingerprints (JSON): written by save, read by compare")
    args = p.parse_args(argv)
    disasm = nvdisasm()
    if disasm is None:
        print(f"bench.sass_identity: nvdisasm not found: {NVDISASM_HOW}", file=sys.stderr)
        return 2
    if args.action == "compare":
        try:
            with open(args.file) as f:
                before = {k: tuple(v) for k, v in json.load(f).items()}
        except OSError as e:
            print(f"bench.sass_identity: cannot read {args.file}: {e.strerror}", file=sys.stderr)
            return 2
    now = fingerprints(disasm)
    if args.action == "save":
        with open(args.file, "w") as f:
            json.dump(now, f, indent=0)
        print(f"{len(now)} specs fingerprinted into {args.file}")
        return 0
    differ = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    for k in differ:
        b, n = before.get(k), now.get(k)
        print(f"differs: {k}: {b[1] if b else 'absent'} -> {n[1] if n else 'absent'} instructions")
    print(f"{len(now)} specs, {len(differ)} with different SASS")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
