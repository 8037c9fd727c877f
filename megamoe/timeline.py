"""Where a fused call's time went, by the kernel's own clock: the timeline build's stamps.

    y, tl = layer(x, x_sf, topk_idx, topk_weights, timeline=True)
    print(tl.format())

The timeline build (jit.build.FusedSpec(timeline=True), kernel/common/timeline.cuh) is the release
build with %globaltimer stamps (ns, one clock for every SM) that each CTA writes at its phases
(contract.TIMELINE_PHASES), its TMA thread at each item it takes, and its consumers (or, in the
prefill engine, its epilogue warps) when they finish the item's mainloop and its epilogue
(contract.TIMELINE_ITEM_STAMPS).
Its y is the release build's bit for bit (tests/gpu/test_timeline.py asserts it; it passes on the
H200, bench/NOTES.md v33). Its time is close to the release build's but not the same:
a few global stores per item, and ptxas spills differently (the fast mode's prefill engine 596
bytes against 316, bench/NOTES.md v31); time the layer with the release build (bench.layer), and
split it with this one (bench.timeline, which prints both).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .jit import contract as C

PHASES = tuple(name for name, _ in C.TIMELINE_PHASES)
ITEM_STAMPS = tuple(name for name, _ in C.TIMELINE_ITEM_STAMPS)


def _nanmedian(v: np.ndarray) -> float:
    """The median of the stamped values (NaN where none is)."""
    v = v[~np.isnan(v)]
    return float(np.median(v)) if v.size else float("nan")


@dataclasses.dataclass(frozen=True)
class Items:
    """The stamped items of one layer: the CTA that took each, its number among that CTA's items (both
    layers'), its index among the layer's items, and its stamps (ITEM_STAMPS: taken, gated, issued,
    computed, written), us from the call's first CTA entry (NaN: not stamped by this call)."""

    cta: np.ndarray  # int [n]
    number: np.ndarray  # int [n]
    index: np.ndarray  # int [n]
    stamps: np.ndarray  # float64 [n, len(ITEM_STAMPS)]

    def stamp(self, name: str) -> np.ndarray:
        return self.stamps[:, ITEM_STAMPS.index(name)]


@dataclasses.dataclass(frozen=True)
class Timeline:
    """One call of the timeline build. phases: [CTAs, len(PHASES)] us from the first CTA's entry (NaN
    where a CTA did not stamp a phase: the predecode's phases on the swap-AB engine or on a layer made
    with predecoded=True); counts: the items
    each CTA took (the first contract.TIMELINE_ITEMS of a CTA's are stamped); items: per layer (1, 2)."""

    engine: str
    phases: np.ndarray
    counts: np.ndarray
    items: dict[int, Items]

    @classmethod
    def from_bytes(cls, raw: bytes, ctas: int, engine: str) -> Timeline:
        """The array megamoe_timeline of a timeline cubin (its bytes) after a launch of `ctas` CTAs."""
        if ctas > C.TIMELINE_CTAS:
            raise ValueError(f"ctas: at most {C.TIMELINE_CTAS} (contract.TIMELINE_CTAS) are stamped, got {ctas}")
        words = np.frombuffer(raw, dtype=np.uint64).reshape(C.TIMELINE_CTAS, C.TIMELINE_STRIDE)[:ctas]
        P = len(PHASES)
        # The clock's ns run to ~1.7e18 (float64 steps of 256 ns there): differences in integers first.
        entry = words[:, PHASES.index("entry")]
        t0 = np.int64(entry[entry != 0].min())

        def us(stamps: np.ndarray) -> np.ndarray:
            return (stamps.astype(np.int64) - t0).astype(np.float64) / 1e3

        phases = us(words[:, :P])
        # A phase this call did not stamp holds 0, or an earlier call's stamp: a layer made with
        # predecoded=True shares its timeline cubin with the per-call predecode layers, whose rows
        # keep their predecode phases (kernel/common/timeline.cuh). Every stamp of this call comes
        # after its CTA's entry.
        phases[(words[:, :P] == 0) | (words[:, :P] < entry[:, None])] = np.nan
        counts = words[:, P].astype(np.int64)
        per_cta = np.minimum(counts, C.TIMELINE_ITEMS)
        recs = words[:, P + 1 :].reshape(ctas, C.TIMELINE_ITEMS, C.TIMELINE_ITEM_WORDS)
        taken = np.arange(C.TIMELINE_ITEMS)[None, :] < per_cta[:, None]
        cta = np.broadcast_to(np.arange(ctas)[:, None], taken.shape)[taken]
        number = np.broadcast_to(np.arange(C.TIMELINE_ITEMS)[None, :], taken.shape)[taken]
        tags = recs[..., 0][taken]
        raw = recs[..., 1:][taken]
        stamps = us(raw)
        stamps[(raw == 0) | (raw < entry[cta][:, None])] = np.nan
        layer = (tags >> np.uint64(C.TIMELINE_ITEM_TAG)).astype(np.int64)
        index = (tags & np.uint64((1 << C.TIMELINE_ITEM_TAG) - 1)).astype(np.int64)
        items = {
            lay: Items(cta[layer == lay], number[layer == lay], index[layer == lay], stamps[layer == lay])
            for lay in (1, 2)
            if (layer == lay).any()
        }
        return cls(engine, phases, counts, items)

    def phase(self, name: str) -> np.ndarray:
        """[CTAs] us of one phase (NaN where not stamped)."""
        return self.phases[:, PHASES.index(name)]

    @property
    def span_us(self) -> float:
        """From the first CTA's entry to the last CTA's end of its combine."""
        return float(np.nanmax(self.phase("combined")))

    @property
    def unstamped(self) -> int:
        """Items taken past contract.TIMELINE_ITEMS of their CTA (counted, not stamped)."""
        return int(np.maximum(self.counts - C.TIMELINE_ITEMS, 0).sum())

    def phase_rows(self) -> list[tuple[str, float, float, float]]:
        """(phase, min, median, max over the CTAs that stamped it) in us, for the phases stamped."""
        rows = []
        for i, name in enumerate(PHASES):
            col = self.phases[:, i]
            col = col[~np.isnan(col)]
            if col.size:
                rows.append((name, float(col.min()), float(np.median(col)), float(col.max())))
        return rows

    def item_pace(self) -> dict[int, np.ndarray]:
        """Per layer, each item's time in the consumers (us): its `computed` less that of the item its
        CTA ran before it (either layer's), or less the CTA's `gemm` phase for its first. So the
        consumers' mainloop of the item and, in the swap-AB and narrow engines, where the consumers
        write it, the epilogue of the one before (in the prefill engine, the one before's staging,
        which waits for the epilogue warps to free the staging buffer). A narrow-engine item of more
        than 8 rows runs in parts: its pace holds every part, its `written - computed` (the epilogue
        median of layer_rows) the last part's epilogue only."""
        before = self._before("computed")
        return {lay: it.stamp("computed") - before[lay] for lay, it in self.items.items()}

    def _before(self, name: str) -> dict[int, np.ndarray]:
        """Per layer, for each item: stamp `name` of the item its CTA ran before it (either layer's),
        or the CTA's `gemm` phase for its first."""
        stamps = np.full((self.phases.shape[0], C.TIMELINE_ITEMS), np.nan)
        for it in self.items.values():
            stamps[it.cta, it.number] = it.stamp(name)
        before = np.concatenate([self.phase("gemm")[:, None], stamps[:, :-1]], axis=1)
        return {lay: before[it.cta, it.number] for lay, it in self.items.items()}

    def item_split(self) -> dict[int, dict[str, np.ndarray]]:
        """The prefill engine's consumer time of each item in three (us; NaN in the other engines, which
        stamp neither `ready` nor `staged`): `start`, from the item before's `staged` (or the CTA's
        `gemm` phase) to this one's first stage landed, what the consumers wait for the ring; `loop`,
        from then to `computed`, the mainloop; `staging`, from then to `staged`, the rows' factors, the
        biases and the wait for the staging buffer."""
        before = self._before("staged")
        return {
            lay: dict(
                start=it.stamp("ready") - before[lay],
                loop=it.stamp("computed") - it.stamp("ready"),
                staging=it.stamp("staged") - it.stamp("computed"),
            )
            for lay, it in self.items.items()
        }

    def layer_rows(self) -> list[dict]:
        """Per layer: its items, the first taken and last issued (us), the gate waits (gated - taken) of
        its items (median, max) and summed over each CTA's items of the layer (median and max over the
        CTAs that took any), and the medians of its items' time in the consumers (item_pace) and of
        their epilogues (written - computed)."""
        rows = []
        pace = self.item_pace()
        split = self.item_split()
        for lay, it in sorted(self.items.items()):
            wait = it.stamp("gated") - it.stamp("taken")
            per_cta = np.bincount(it.cta, weights=wait, minlength=self.phases.shape[0])
            per_cta = per_cta[np.bincount(it.cta, minlength=self.phases.shape[0]) > 0]
            rows.append(
                dict(
                    layer=lay,
                    items=int(it.index.size),
                    first_taken=float(it.stamp("taken").min()),
                    last_issued=float(it.stamp("issued").max()),
                    gate_median=float(np.median(wait)),
                    gate_max=float(wait.max()),
                    gate_cta_median=float(np.median(per_cta)),
                    gate_cta_max=float(per_cta.max()),
                    pace_median=_nanmedian(pace[lay]),
                    epilogue_median=_nanmedian(it.stamp("written") - it.stamp("computed")),
                    **{f"{k}_median": _nanmedian(v) for k, v in split[lay].items()},
                    **{
                        f"{k}_mean": float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")
                        for k, v in split[lay].items()
                    },
                )
            )
        return rows

    def format(self) -> str:
        """The two tables: the phases over the CTAs, then the items of each layer."""
        docs = dict(C.TIMELINE_PHASES)
        out = [
            f"engine {self.engine}, {self.phases.shape[0]} CTAs; us from the first CTA's entry (globaltimer)",
            f"{'phase':<12} {'min':>9} {'median':>9} {'max':>9}  when",
        ]
        out += [f"{n:<12} {lo:9.1f} {med:9.1f} {hi:9.1f}  {docs[n]}" for n, lo, med, hi in self.phase_rows()]
        out.append("")
        out.append(
            f"{'layer':<6} {'items':>6} {'first taken':>12} {'last issued':>12} {'gate wait median / max':>23}"
            f" {'gate wait a CTA, median / max':>30} {'item / epilogue median':>23}"
        )
        for r in self.layer_rows():
            gate = f"{r['gate_median']:.1f} / {r['gate_max']:.1f}"
            cta = f"{r['gate_cta_median']:.1f} / {r['gate_cta_max']:.1f}"
            pace = f"{r['pace_median']:.2f} / {r['epilogue_median']:.2f}"
            out.append(
                f"L{r['layer']:<5} {r['items']:>6} {r['first_taken']:>12.1f} {r['last_issued']:>12.1f} {gate:>23}"
                f" {cta:>30} {pace:>23}"
            )
        rows = [r for r in self.layer_rows() if not np.isnan(r["loop_median"])]
        if rows:
            out.append("")
            out.append(
                f"{'layer':<6} {'consumers: start wait':>22} {'mainloop':>16} {'staging':>16}  (us, median / mean: item_split)"
            )
            for r in rows:
                cells = [f"{r[k + '_median']:.2f} / {r[k + '_mean']:.2f}" for k in ("start", "loop", "staging")]
                out.append(f"L{r['layer']:<5} {cells[0]:>22} {cells[1]:>16} {cells[2]:>16}")
        if self.unstamped:
            out.append(f"({self.unstamped} items past the first {C.TIMELINE_ITEMS} of their CTA: counted, not stamped)")
        return "\n".join(out)
