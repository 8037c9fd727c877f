"""The timeline build's host side on the CPU: its spec and source, and megamoe.timeline reading a
stamp array laid out as contract.TIMELINE_* says (the kernel's side: tests/gpu/test_timeline.py; the
release cubins without the array: tests/test_compile_gate.py)."""

from __future__ import annotations

import numpy as np
import pytest

from megamoe.jit import build as jb
from megamoe.jit import contract as C
from megamoe.timeline import ITEM_STAMPS, PHASES, Timeline


def test_the_timeline_spec_is_its_own_build_with_the_define_and_refuses_the_debug_build():
    spec = jb.FusedSpec(promotion="k32", engine="prefill", timeline=True)
    release = jb.FusedSpec(promotion="k32", engine="prefill")
    assert spec.name == release.name + "_tl"
    assert spec.source().startswith("#define MEGAMOE_TIMELINE 1\n")
    assert "MEGAMOE_TIMELINE" not in release.source()
    assert jb.spec_key(spec) != jb.spec_key(release)
    with pytest.raises(ValueError, match="timeline"):
        jb.FusedSpec(promotion="k32", debug=True, timeline=True)


def test_a_row_is_the_phases_the_count_and_the_items():
    assert C.TIMELINE_STRIDE == len(C.TIMELINE_PHASES) + 1 + C.TIMELINE_ITEMS * (1 + len(C.TIMELINE_ITEM_STAMPS))
    assert PHASES[0] == "entry" and PHASES[-1] == "combined"
    assert ITEM_STAMPS == ("taken", "gated", "issued", "computed", "written", "ready", "staged")


def _array(ctas: int) -> np.ndarray:
    return np.zeros((C.TIMELINE_CTAS, C.TIMELINE_STRIDE), dtype=np.uint64)


def _put_item(a, cta: int, n: int, layer: int, index: int, stamps_ns) -> None:
    base = len(PHASES) + 1 + n * C.TIMELINE_ITEM_WORDS
    a[cta, base] = (layer << C.TIMELINE_ITEM_TAG) | index
    a[cta, base + 1 : base + 1 + len(stamps_ns)] = stamps_ns


def test_timeline_reads_phases_and_items_relative_to_the_first_entry():
    a = _array(2)
    t0 = 5_000_000_000  # the globaltimer's ns, far from 0
    for cta, shift in ((0, 0), (1, 2000)):
        for i, p in enumerate(PHASES):
            if p in ("pulled", "decoded", "decoded_all"):
                continue  # the swap-AB engine stamps no predecode
            a[cta, i] = t0 + shift + 1000 * i
    # CTA 0: L1 item 0 (gate wait 3 us), L2 item 0 (1 us); CTA 1: L1 item 1 (0 us). Their consumers'
    # stamps: computed, then written 2 us (L1) and 1 us (L2) later.
    _put_item(a, 0, 0, 1, 0, [t0 + 10_000, t0 + 13_000, t0 + 20_000, t0 + 25_000, t0 + 27_000])
    _put_item(a, 0, 1, 2, 0, [t0 + 21_000, t0 + 22_000, t0 + 30_000, t0 + 35_000, t0 + 36_000])
    _put_item(a, 1, 0, 1, 1, [t0 + 12_000, t0 + 12_000, t0 + 19_000, t0 + 24_000, t0 + 26_000])
    a[0, len(PHASES)] = 2
    a[1, len(PHASES)] = 1
    a[5, 0] = 1  # a CTA past the launch's grid: never read
    tl = Timeline.from_bytes(a.tobytes(), 2, "swapab")

    assert tl.phase("entry").tolist() == [0.0, 2.0]
    assert np.isnan(tl.phase("decoded")).all()
    rows = {r[0]: r[1:] for r in tl.phase_rows()}
    assert "decoded" not in rows and rows["combined"] == (10.0, 11.0, 12.0)
    assert tl.span_us == 12.0
    assert tl.counts.tolist() == [2, 1] and tl.unstamped == 0
    assert tl.items[1].index.tolist() == [0, 1] and tl.items[1].cta.tolist() == [0, 1]
    l1, l2 = tl.layer_rows()
    assert (l1["items"], l1["first_taken"], l1["last_issued"]) == (2, 10.0, 20.0)
    assert (l1["gate_median"], l1["gate_max"], l1["gate_cta_max"]) == (1.5, 3.0, 3.0)
    assert (l2["layer"], l2["items"], l2["gate_max"]) == (2, 1, 1.0)
    # An item's time in the consumers: from the CTA's item before it (CTA 0's L2 item: its L1 item at
    # 25 us), or from the CTA's gemm phase (6 us for CTA 0, 8 us for CTA 1) for its first.
    assert tl.item_pace()[1].tolist() == [19.0, 16.0] and tl.item_pace()[2].tolist() == [10.0]
    assert (l1["pace_median"], l1["epilogue_median"], l2["pace_median"], l2["epilogue_median"]) == (
        17.5,
        2.0,
        10.0,
        1.0,
    )
    text = tl.format()
    assert "engine swapab, 2 CTAs" in text and "\nL1 " in text and "decoded" not in text


def test_a_prefill_items_consumer_time_splits_into_its_start_wait_mainloop_and_staging():
    a = _array(1)
    t0 = 5_000_000_000
    for i in range(len(PHASES)):
        a[0, i] = t0 + 1000 * i  # gemm at 6 us
    # taken, gated, issued, computed, written, ready, staged (us): item 0 ready at 7, computed at 30,
    # staged at 31; item 1 ready at 34 (3 us after item 0 staged), computed at 60, staged at 62.
    _put_item(a, 0, 0, 1, 0, [t0 + 6_000, t0 + 6_000, t0 + 25_000, t0 + 30_000, t0 + 40_000, t0 + 7_000, t0 + 31_000])
    _put_item(
        a, 0, 1, 2, 0, [t0 + 20_000, t0 + 20_000, t0 + 55_000, t0 + 60_000, t0 + 70_000, t0 + 34_000, t0 + 62_000]
    )
    a[0, len(PHASES)] = 2
    tl = Timeline.from_bytes(a.tobytes(), 1, "prefill")
    split = tl.item_split()
    assert [split[1][k].tolist() for k in ("start", "loop", "staging")] == [[1.0], [23.0], [1.0]]
    assert [split[2][k].tolist() for k in ("start", "loop", "staging")] == [[3.0], [26.0], [2.0]]
    l1, l2 = tl.layer_rows()
    assert (l2["start_median"], l2["loop_mean"], l2["staging_median"]) == (3.0, 26.0, 2.0)
    assert "consumers: start wait" in tl.format() and "3.00 / 3.00" in tl.format()


def test_stamps_at_the_clocks_real_magnitude_keep_their_nanoseconds():
    """%globaltimer counts ns since 1970 (~1.7e18, where float64 steps by 256 ns): 100 ns apart
    must read 0.1 us apart."""
    a = _array(1)
    t0 = 1_733_000_000_123_456_789
    for i in range(len(PHASES)):
        a[0, i] = t0 + 100 * i
    _put_item(a, 0, 0, 1, 0, [t0 + 1000, t0 + 1100, t0 + 1300])
    a[0, len(PHASES)] = 1
    tl = Timeline.from_bytes(a.tobytes(), 1, "prefill")
    assert np.allclose(tl.phases[0], 0.1 * np.arange(len(PHASES)), rtol=0, atol=1e-9)
    assert np.allclose(tl.items[1].stamps[0, :3], [1.0, 1.1, 1.3], rtol=0, atol=1e-9)
    assert np.isclose(tl.layer_rows()[0]["gate_max"], 0.1, rtol=0, atol=1e-9)
    # The consumers' stamps were not written (0): not stamped, and their medians say so.
    assert np.isnan(tl.items[1].stamp("written")).all() and np.isnan(tl.layer_rows()[0]["epilogue_median"])


def test_an_earlier_calls_stamps_of_a_phase_this_call_skipped_read_as_not_stamped():
    # A per-call-predecode layer's call, then a predecoded layer's on the same timeline cubin: its
    # rows keep the first call's predecode stamps, which come before this call's entries.
    a = _array(2)
    old, t0 = 7_000_000_000, 9_000_000_000
    for cta in (0, 1):
        for i, p in enumerate(PHASES):
            a[cta, i] = (old if p in ("pulled", "decoded", "decoded_all") else t0) + 1000 * i
    tl = Timeline.from_bytes(a.tobytes(), 2, "prefill")
    for p in PHASES:
        assert np.isnan(tl.phase(p)).all() == (p in ("pulled", "decoded", "decoded_all")), p
    assert "decoded" not in tl.format()


def test_items_past_a_ctas_capacity_are_counted_and_not_read():
    a = _array(1)
    a[0, 0] = 1
    a[0, len(PHASES)] = C.TIMELINE_ITEMS + 3
    for n in range(C.TIMELINE_ITEMS):
        _put_item(a, 0, n, 1, n, [2, 3, 4])
    tl = Timeline.from_bytes(a.tobytes(), 1, "prefill")
    assert tl.unstamped == 3 and tl.items[1].index.size == C.TIMELINE_ITEMS
    assert "3 items past the first" in tl.format()
    with pytest.raises(ValueError, match="TIMELINE_CTAS"):
        Timeline.from_bytes(a.tobytes(), C.TIMELINE_CTAS + 1, "prefill")


def test_bench_timeline_refuses_bad_arguments_and_says_in_one_line_that_it_needs_a_gpu(capsys):
    import torch

    from bench import timeline

    with pytest.raises(SystemExit):
        timeline.parse_args(["--tokens", "0"])
    assert "at least 1" in capsys.readouterr().err
    args = timeline.parse_args(["--shape", "dsv3", "--tokens", "8"])
    assert (args.shape, args.tokens, args.promotion, args.engine) == ("dsv3", 8, "k32", "auto")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        timeline.main(["--tokens", "8"])
