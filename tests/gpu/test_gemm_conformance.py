"""The SM90 GEMM core through the conformance suite: the kernel's L1 and L2 run on the reference's
pools (D4) for 2 ranks, their outputs replace D5-D8 in the dumps, and every stage checker runs —
GEMM_BOUND on D5/D7 with the promotion's declared tau, EXACT on D6/D8, then combine and cleanup."""

import pytest
import torch

from megamoe import gemm
from megamoe import reference as ref
from megamoe.conformance.dump import make_dumps
from megamoe.conformance.suite import check
from megamoe.jit.layout import transform_weights


TAU = gemm.TAU


def kernel_dumps(cfg: ref.MoEConfig, inputs, weights, promotion: str):
    """Reference dumps with D5-D8 (and y from the dumped combine buffer) taken from the kernel."""
    result = ref.run_reference(cfg, inputs, weights)
    dumps = [dict(d) for d in result.dumps]
    e_l, t_max = cfg.local_experts, cfg.max_tokens_per_rank
    buffers = [ref.empty_combine_buffer(cfg.top_k, t_max, cfg.hidden, "cuda") for _ in range(cfg.num_ranks)]
    for rank, d in enumerate(dumps):
        local = weights.slice(rank * e_l, (rank + 1) * e_l)
        kw = transform_weights(local.w1, local.w1_sf, local.w2, local.w2_sf)
        offsets, counts = d["D4.expert_offsets"], d["D2.recv_totals"]
        l1 = gemm.l1_gemm(
            d["D4.pool_x"],
            d["D4.pool_x_sf"],
            offsets,
            counts,
            d["D4.pool_weights"],
            kw,
            fast_math=cfg.fast_math,
            activation_clamp=cfg.activation_clamp,
            promotion=promotion,
            debug=True,
        )
        d["D5.acc1"], d["D6.l2_acts"], d["D6.l2_sf"] = l1.acc1, l1.l2_acts.view(torch.uint8), l1.l2_sf
        meta, valid = d["D4.pool_meta"], ref.valid_rows(d)
        for s, buf in enumerate(buffers):  # this owner's rows for each source rank's buffer
            mine = valid & (meta[:, 0] == s)
            dst = torch.where(mine, meta[:, 2] * t_max + meta[:, 1], -1).to(torch.int32)
            l2 = gemm.l2_gemm(l1.l2_acts, l1.l2_sf, offsets, counts, dst, kw, buf, promotion=promotion, debug=True)
            d["D7.acc2"] = l2.acc2
    for rank, (d, inp) in enumerate(zip(dumps, inputs)):
        d["D8.combine"] = buffers[rank]
        d["D9.y"] = ref.combine(buffers[rank], inp.topk_idx)
    return make_dumps(
        cfg,
        inputs,
        weights,
        dumps,
        kernel_mode=f"sm90-gemm-{promotion}",
        build_id="standalone",
        tau={"D5": TAU[promotion], "D7": TAU[promotion]},
    )


@pytest.mark.parametrize("promotion", ["k32", "k128"])
@pytest.mark.parametrize("fast_math,clamp", [(True, None), (False, 1.5)])
def test_kernel_gemms_conform(promotion, fast_math, clamp):
    cfg = ref.MoEConfig(
        hidden=1024,
        intermediate=512,
        num_experts=8,
        top_k=4,
        num_ranks=2,
        max_tokens_per_rank=96,
        block_m=64,
        activation_clamp=clamp,
        fast_math=fast_math,
    )
    inputs = [i.to("cuda") for i in ref.make_inputs(cfg, [96, 71], seed=7, distribution="skewed", masked_ratio=0.1)]
    weights = ref.random_weights(8, 1024, 512, seed=7, device="cuda")
    report = check(kernel_dumps(cfg, inputs, weights, promotion), end_to_end=True)
    print(report.text())
    assert report.ok, report.text()
