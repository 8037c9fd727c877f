"""The fused layer running gpt-oss's activation (SPEC §8, `activation="swiglu_oai"`): its D6 (b1
before the bf16 rounding, the clamp at bf16(limit), the glu table, (up + 1), the routing weight)
and D8 (acc2 + fp32(w_route · b2), one rounding each) in both engines' epilogues, every dump point
through the conformance suite, on one rank and both promotions, with and without biases; the
release build against the debug build; a per-call clamp refused for the variant.

Run: pytest -s tests/gpu/test_fused_oai.py"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe import reference as ref
from megamoe.conformance.suite import check
from megamoe.jit import build as jb
from megamoe.moe import MegaMoE
from megamoe.runtime import release_prefill_buffers

# H and I multiples of 512: the fast mode's (promotion "k128") smallest.
CFG = ref.MoEConfig(
    hidden=512,
    intermediate=512,
    num_experts=8,
    top_k=4,
    num_ranks=1,
    max_tokens_per_rank=128,
    block_m=64,
    activation="swiglu_oai",
)


def _weights(cfg=CFG, biases=True, seed=3):
    w = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=seed)
    if biases:
        g = torch.Generator().manual_seed(seed)
        # Wide enough that the limit (7) clamps some gates and ups, and some biases are -0.0.
        w.b1 = torch.randn(cfg.num_experts, 2 * cfg.intermediate, generator=g).mul(3).to(torch.bfloat16)
        w.b2 = torch.randn(cfg.num_experts, cfg.hidden, generator=g).to(torch.bfloat16)
        w.b1[0, :16] = -0.0
    return w.to("cuda")


_LAYERS: dict = {}


# Every engine of the fused kernel layer its promotion has (the layer's own choice at these sizes is
# the swap-AB one; the narrow engine, the exact mode's, runs pool blocks of more than 8 rows in parts).
MODES = jb.FUSED_MODES


def _layer(promotion: str, biases: bool = True, engine: str = "swapab") -> MegaMoE:
    key = (promotion, biases, engine)
    if key not in _LAYERS:
        _LAYERS[key] = MegaMoE(CFG, _weights(biases=biases), promotion=promotion, engine=engine)
    return _LAYERS[key]


CASES = [
    ("uniform", 128, 0.0, dict()),
    ("skewed", 100, 0.1, dict(fast_math=False)),
    ("empty_experts", 77, 0.25, dict()),
    ("uniform", 1, 0.0, dict()),
    ("uniform", 0, 0.0, dict()),
]


@pytest.mark.parametrize("promotion,engine", MODES)
@pytest.mark.parametrize("biases", [True, False], ids=["biases", "no-biases"])
@pytest.mark.parametrize("distribution,tokens,masked,mode", CASES, ids=[f"{c[0]}-T{c[1]}-m{c[2]}" for c in CASES])
def test_every_dump_point_of_the_gpt_oss_variant_conforms(
    distribution, tokens, masked, mode, promotion, biases, engine
):
    layer = _layer(promotion, biases, engine)
    inp = ref.make_inputs(CFG, tokens, seed=11, distribution=distribution, masked_ratio=masked, device="cuda")[0]
    y, dumps = layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights, debug=True, **mode)
    assert dumps[0].meta["build_id"].split("_")[3] == engine
    assert ("weights.b1" in dumps[0].tensors) == biases
    report = check(dumps, end_to_end=tokens > 0 and masked < 1.0)
    print(report.text())
    assert report.ok, report.text()
    assert torch.equal(y.view(torch.int16).cpu(), dumps[0]["D9.y"].view(torch.int16))


@pytest.mark.parametrize(
    "tokens,engine", [(1, "swapab"), (64, "swapab"), (100, "swapab"), (100, "prefill"), (1, "narrow"), (8, "narrow")]
)
def test_a_gpt_oss_20b_slice_conforms_at_its_sizes_h_i_2880(tokens, engine):
    # gpt-oss-20b's expert shape (H = I = 2880, top-4) with 8 of its 32 experts: the exact mode, x
    # [T, 2880] and its scales [T, 90] as they are, padded only inside the kernel's layouts.
    cfg = dataclasses.replace(CFG, hidden=2880, intermediate=2880)
    layer = MegaMoE(cfg, _weights(cfg), promotion="k32", engine=engine)
    inp = ref.make_inputs(cfg, tokens, seed=2, device="cuda")[0]
    y, dumps = layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights, debug=True)
    report = check(dumps)
    assert report.ok, report.text()
    assert torch.equal(y, layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights))


@pytest.mark.parametrize("promotion,engine", MODES)
def test_the_release_build_gives_the_debug_builds_bits(promotion, engine):
    layer = _layer(promotion, engine=engine)
    inp = ref.make_inputs(CFG, 128, seed=5, distribution="skewed", device="cuda")[0]
    y_dbg, _ = layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights, debug=True)
    y = layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    torch.cuda.synchronize()
    assert torch.equal(y.view(torch.int16), y_dbg.view(torch.int16))


def test_a_per_call_clamp_is_refused_for_the_variant_and_auto_takes_either_engine():
    layer = MegaMoE(CFG, _weights(), promotion="k32")
    inp = ref.make_inputs(CFG, 8, seed=1, device="cuda")[0]
    with pytest.raises(ref.MegaMoEInputError, match="argument 'activation_clamp'"):
        layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights, activation_clamp=3.0)
    # Up to 8 expected rows an expert (T K / E = T / 2: T 16) the narrow engine; from 128 (T 256) the
    # prefill engine, as for SPEC §3
    assert layer.engine_for(16) == "narrow" and layer.engine_for(17) == "swapab" and layer.engine_for(256) == "prefill"


@pytest.mark.parametrize(
    "promotion,hidden", [("k32", 512), ("k128", 512), ("k32", 2880)], ids=["k32", "k128", "k32-2880"]
)
def test_a_predecoded_layers_prefill_engine_gives_the_per_call_predecodes_bits_and_conforms(promotion, hidden):
    # MegaMoE(predecoded=True): the prefill engine reads the weights decoded by the standalone pass
    # when the layer was made, and skips its per-call predecode. At 2880 the layers' rows are padded
    # to 128-row blocks whose rows past H or 2I are no row of the layer.
    cfg = dataclasses.replace(CFG, hidden=hidden, intermediate=hidden)
    w = _weights(cfg)
    release_prefill_buffers()  # per_call's first call decodes into fresh (zeroed) scratch buffers
    per_call = MegaMoE(cfg, w, promotion=promotion, engine="prefill")
    kept = MegaMoE(cfg, w, promotion=promotion, engine="prefill", predecoded=True)
    for tokens, distribution in ((128, "skewed"), (77, "empty_experts"), (1, "uniform"), (0, "uniform")):
        inp = ref.make_inputs(cfg, tokens, seed=4, distribution=distribution, device="cuda")[0]
        args = (inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
        y, dumps = kept(*args, debug=True)
        report = check(dumps, end_to_end=tokens > 0)
        assert report.ok, report.text()
        want = per_call(*args).view(torch.int16)
        assert torch.equal(y.view(torch.int16), want), f"T={tokens}: the debug build's y"
        assert torch.equal(kept(*args).view(torch.int16), want), f"T={tokens}: the release build's y"
    # The layer's own buffers are the bytes the kernel's predecode wrote into the scratch (both
    # zeroed first, so the tiles' unwritten parts agree too), and its calls took no scratch buffer.
    assert not kept._scratch
    (scratch,) = {tuple(t.data_ptr() for t in b): b for b in per_call._scratch.values()}.values()
    for layer, (mine, theirs) in enumerate(zip(kept._decoded, scratch), start=1):
        assert torch.equal(mine, theirs), f"L{layer}'s predecoded tiles"
    # Its other engines decode in their consumers as before; its calls never wait on the predecode
    # counter, so that hang cannot be planted.
    inp = ref.make_inputs(cfg, 128, seed=4, distribution="skewed", device="cuda")[0]
    args = (inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    kept.engine = per_call.engine = "swapab"
    assert torch.equal(kept(*args).view(torch.int16), per_call(*args).view(torch.int16))
    with pytest.raises(ref.MegaMoEInputError, match="argument 'wait'"):
        kept.withhold("decoded")
