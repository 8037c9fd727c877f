"""The fused layer's timeline build (megamoe.timeline, kernel/common/timeline.cuh) on both engines and
promotions: its y is the release build's bit for bit, every CTA stamps its engine's phases in their
order, and the items its TMA threads stamped are each layer's items, each taken once.

Run: pytest -s tests/gpu/test_timeline.py"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megamoe import reference as ref
from megamoe.jit import build as jb
from megamoe.jit import contract as C
from megamoe.moe import MegaMoE
from megamoe.timeline import PHASES

# H and I multiples of 512 (the fast mode's smallest), the variant's biases: both epilogues' full work.
CFG = ref.MoEConfig(
    hidden=512,
    intermediate=512,
    num_experts=8,
    top_k=4,
    num_ranks=1,
    max_tokens_per_rank=256,
    block_m=64,
    activation="swiglu_oai",
)
PREDECODE = ("pulled", "decoded", "decoded_all")


def expected_items(engine: str, promotion: str, topk_idx) -> dict[int, int]:
    """Each layer's items: the experts' token blocks times the layer's blocks of weight rows (the
    engine's CTA tile: PREFILL_ROWS on the prefill engine, else 64 a consumer warpgroup), token blocks
    of PREFILL_TOKENS (prefill) or BLOCK_M rows."""
    wgs = jb.FusedSpec(promotion=promotion, engine=engine).wgs
    rows = C.PREFILL_ROWS[promotion] if engine == "prefill" else C.ROWS_PER_WG * wgs
    block = C.PREFILL_TOKENS[promotion] if engine == "prefill" else CFG.block_m
    counts = ref.send_counts(topk_idx, CFG.num_experts)
    blocks = int(((counts + block - 1) // block).sum())
    # A layer's last block of rows may be partial (a CTA tile of 192 rows over 1024: v34's three-
    # warpgroup patch), and is an item too.
    return {1: blocks * -(-(2 * CFG.intermediate) // rows), 2: blocks * -(-CFG.hidden // rows)}


# Every engine, and the prefill engine of a layer whose weights were decoded when it was made
# (MegaMoE(predecoded=True): no predecode phase).
MODES = [(p, e, False) for p, e in jb.FUSED_MODES] + [(p, "prefill", True) for p in jb.PROMOTIONS]


@pytest.mark.parametrize("promotion,engine,predecoded", MODES)
def test_the_timeline_build_gives_the_release_bits_and_stamps_every_phase_and_item_once(promotion, engine, predecoded):
    w = ref.random_weights(CFG.num_experts, CFG.hidden, CFG.intermediate, seed=5)
    w.b1, w.b2 = ref.random_biases(CFG.num_experts, CFG.hidden, CFG.intermediate, seed=5)
    layer = MegaMoE(CFG, w.to("cuda"), promotion=promotion, engine=engine, predecoded=predecoded)
    inp = ref.make_inputs(CFG, 200, seed=7, distribution="skewed", device="cuda")[0]
    args = (inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    y = layer(*args).clone()
    for _ in range(2):  # the second call's stamps replace the first's (item counts zeroed at entry)
        y_tl, tl = layer(*args, timeline=True)
    torch.cuda.synchronize()
    assert torch.equal(y_tl.view(torch.int16), y.view(torch.int16)), "the timeline build changed y"
    assert tl.engine == engine

    # Every CTA stamped every phase of its engine, in order (one clock for all SMs).
    want = [p for p in PHASES if (engine == "prefill" and not predecoded) or p not in PREDECODE]
    stamped = [p for p in PHASES if not np.isnan(tl.phase(p)).all()]
    assert stamped == want, stamped
    times = np.stack([tl.phase(p) for p in want], axis=1)
    assert not np.isnan(times).any(), "a CTA missed a phase"
    assert (np.diff(times, axis=1) >= 0).all(), "phases out of order"
    assert tl.span_us > 0

    # Each layer's items, each once, with taken <= gated <= issued, and every item computed and then
    # written by the roles after the TMA thread, in its order (computed after the CTA's gemm phase).
    assert tl.unstamped == 0
    want_items = expected_items(engine, promotion, inp.topk_idx)
    assert sorted(tl.items) == [1, 2]
    pace = tl.item_pace()
    for lay, it in tl.items.items():
        assert np.array_equal(np.sort(it.index), np.arange(want_items[lay])), f"L{lay}'s item indices"
        assert (it.stamp("taken") <= it.stamp("gated")).all() and (it.stamp("gated") <= it.stamp("issued")).all()
        computed, written = it.stamp("computed"), it.stamp("written")
        assert not np.isnan(computed).any() and not np.isnan(written).any(), f"L{lay}: an item not computed or written"
        assert (computed <= written).all() and (it.stamp("taken") <= computed).all()
        assert (pace[lay] > 0).all(), f"L{lay}: the consumers ran an item before the one before it"
        # The prefill consumers' item in three: its first stage landed, computed, staged, each after
        # the one before, the item's start after the tile before it was staged (item_split).
        ready, staged = it.stamp("ready"), it.stamp("staged")
        if engine == "prefill":
            assert (it.stamp("taken") <= ready).all() and (ready <= computed).all() and (computed <= staged).all()
            split = tl.item_split()[lay]
            assert all((part >= 0).all() for part in split.values()), f"L{lay}: a negative part of {sorted(split)}"
        else:
            assert np.isnan(ready).all() and np.isnan(staged).all(), "ready and staged are the prefill engine's"
    assert int(tl.counts.sum()) == sum(it.index.size for it in tl.items.values())
    print(tl.format())
