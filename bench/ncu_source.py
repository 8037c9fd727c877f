"""Where a kernel's warps stall, per SASS instruction, from ncu's source page:

    ncu --section SourceCounters -o REP ... ; ncu -i REP.ncu-rep --page source --csv --print-source sass > SRC.csv
    python -m bench.ncu_source SRC.csv [TOP]

Prints the instructions with the most warp-state samples (each with its three largest stall
reasons) and the samples per window of 32 consecutive instructions (the hot loops), both as shares
of all samples. ncu names its columns differently between versions, so they are found by their
words: the sampling column has "Sampling" and "All", the stall reasons are the other sampling
columns."""

import csv
import sys


def _num(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    with open(sys.argv[1], newline="") as f:
        rows = list(csv.reader(f))
    head_i = next(i for i, r in enumerate(rows) if any("Source" in c for c in r))
    head, body = rows[head_i], [r for r in rows[head_i + 1 :] if len(r) == len(rows[head_i])]
    col = {name: i for i, name in enumerate(head)}
    src = next(i for n, i in col.items() if n.strip() == "Source" or n.startswith("Source"))
    addr = next((i for n, i in col.items() if "Address" in n), None)
    samples = next(i for n, i in col.items() if "Sampling" in n and "All" in n)
    reasons = [i for n, i in col.items() if i != samples and ("stall" in n.lower() or "Sampling" in n)]
    reasons = [i for i in reasons if "Not" not in head[i]]
    print("columns:", "; ".join(head), file=sys.stderr)
    total = sum(_num(r[samples]) for r in body) or 1.0
    print(f"{len(body)} instructions, {total:.0f} samples")
    ranked = sorted(range(len(body)), key=lambda i: -_num(body[i][samples]))
    print(f"\n## top {top} instructions (% of all samples)")
    for i in ranked[:top]:
        r = body[i]
        why = sorted(((_num(r[j]), head[j]) for j in reasons), reverse=True)[:3]
        why_s = ", ".join(f"{n.split('(')[0].strip()[-28:]} {v / total * 100:.1f}" for v, n in why if v > 0)
        a = r[addr] if addr is not None else str(i)
        print(f"{_num(r[samples]) / total * 100:5.2f}  {i:6d} {a:>8}  {r[src].strip()[:70]:70}  {why_s}")
    print("\n## windows of 32 instructions with >= 0.5 % of the samples")
    for w in range(0, len(body), 32):
        s = sum(_num(r[samples]) for r in body[w : w + 32])
        if s / total >= 0.005:
            first = body[w][src].strip()[:50]
            print(f"{s / total * 100:5.1f}  [{w:6d}, {w + 32:6d})  {first}")


if __name__ == "__main__":
    main()
