"""The fast mode's shared-memory decode (GemmSpec.decode="smem", kernel/gemm/gemm_sm90_ss.cuh: a
transform warpgroup decodes the weights, SS wgmma) against the register decode: bit-identical
accumulators and outputs, and through the same GEMM_BOUND / D6 / D8 checks."""
from __future__ import annotations

import pytest
import torch

from megamoe import gemm as G

from .gemm_helpers import COUNTS, check_l1_epilogue, check_l2_epilogue, combine_rows, setup_l1, worst_bound_ratio

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("block_n", [64, 128])
def test_smem_decode_l1_equals_register_decode(block_n):
    H, inter = 1024, 1024
    pool, (w1, s1, _, _), kw = setup_l1(H, inter, COUNTS + [129, 200], seed=400 + block_n)
    run = lambda decode: G.l1_gemm(pool.x, pool.sf, pool.offsets, pool.num_tokens, pool.w_route, kw,  # noqa: E731
                                   mode="fast", block_n=block_n, debug=True, decode=decode)
    a, b = run("regs"), run("smem")
    torch.cuda.synchronize()
    v = pool.valid
    assert torch.equal(a.acc1[v].view(torch.int32), b.acc1[v].view(torch.int32)), "acc1 differs"
    assert torch.equal(a.l2_acts[v].view(torch.uint8), b.l2_acts[v].view(torch.uint8)), "l2_acts differ"
    assert torch.equal(a.l2_sf[v], b.l2_sf[v]), "l2_sf differ"
    check_l1_epilogue(pool, b, inter, True, None, f"smem decode bn{block_n}")
    worst = worst_bound_ratio(b.acc1, pool, w1, s1)
    assert worst <= G.FAST_TAU


@pytest.mark.parametrize("block_n", [64, 128])
def test_smem_decode_l2_equals_register_decode(block_n):
    H, inter = 1024, 1024
    pool, _, kw = setup_l1(H, inter, COUNTS + [129], seed=500 + block_n)   # pool K = H = I here
    comb, dst = combine_rows(pool, H)
    comb2 = comb.clone()
    a = G.l2_gemm(pool.x, pool.sf, pool.offsets, pool.num_tokens, dst, kw, comb, mode="fast", block_n=block_n,
                  debug=True, decode="regs")
    b = G.l2_gemm(pool.x, pool.sf, pool.offsets, pool.num_tokens, dst, kw, comb2, mode="fast", block_n=block_n,
                  debug=True, decode="smem")
    torch.cuda.synchronize()
    v = pool.valid
    assert torch.equal(a.acc2[v].view(torch.int32), b.acc2[v].view(torch.int32)), "acc2 differs"
    assert torch.equal(comb.view(torch.int16), comb2.view(torch.int16)), "combine rows differ"
    check_l2_epilogue(pool, b.acc2, comb2, dst, f"smem decode bn{block_n}")
