"""The kernel weight layout (megamoe/jit/layout.py) is a bijection: bit-exact round trip, and the
fragment encoding puts each code where kernel/gemm/fp4_decode.cuh expects it. CPU only."""

import torch

from megamoe.jit import layout as L
from megamoe.jit import contract as C


def _codes(packed):
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def test_round_trip():
    g = torch.Generator().manual_seed(0)
    E, inter, H = 2, 256, 384
    w1 = torch.randint(0, 256, (E, 2 * inter, H // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    s1 = torch.randint(0, 255, (E, 2 * inter, H // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    w2 = torch.randint(0, 256, (E, H, inter // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    s2 = torch.randint(0, 255, (E, H, inter // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    kw = L.transform_weights(w1, s1, w2, s2)
    for a, b in zip(L.untransform_weights(kw), (w1, s1, w2, s2)):
        assert torch.equal(a, b)


def test_interleave():
    rows = torch.arange(64).view(1, 64, 1)
    r = L.interleave_gate_up(rows).flatten().tolist()
    assert r[:16] == list(range(8)) + list(range(32, 40))
    assert r[16:24] == list(range(8, 16))
    assert torch.equal(L.deinterleave_gate_up(L.interleave_gate_up(rows)), rows)


def test_fragment_encoding():
    g = torch.Generator().manual_seed(1)
    E, R, K = 1, 32, 256
    packed = torch.randint(0, 256, (E, R, K // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    wk = L.fp4_to_kernel_layout(packed)
    codes = _codes(packed)
    for kb in range(K // 128):
        for rg in range(R // 16):
            for lane in (0, 5, 17, 31):
                gg, t = lane // 4, lane % 4
                for s in range(4):
                    for hk in range(2):
                        off = (s // 2) * 512 + lane * 16 + (s % 2) * 8 + hk * 4
                        b = wk[0, kb, rg, off : off + 4].tolist()
                        word = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
                        for i in range(4):
                            k = 128 * kb + 32 * s + 16 * hk + 4 * t + i
                            ca = ((word >> (4 * i)) & 7) | (((word >> (8 * i + 3)) & 1) << 3)
                            cb = ((word >> (16 + 4 * i)) & 7) | (((word >> (8 * i + 7)) & 1) << 3)
                            assert ca == codes[0, 16 * rg + gg, k]
                            assert cb == codes[0, 16 * rg + gg + 8, k]


def test_fold_blocks_mark_the_128_row_blocks_whose_rows_span_at_most_11_binades():
    """The exact mode's prefill path folds a block's weight scales into its predecoded bytes where that
    leaves the tensor core's sums as they are: every row's scale bytes within 11 of its largest (12
    is one too many), and that within 32 of the expert's largest (33 is one too many)."""
    assert (L.FOLD_BINADES, L.FOLD_ROW_SPREAD) == (11, 32)
    E, R, K = 3, 384, 512
    assert C.PREFILL_ROWS["k32"] == 128
    sf = torch.full((E, R, K // 32), 120, dtype=torch.uint8)
    sf[0, 5, 3] = 109  # row 5: 120 - 109 = 11 binades: block 0 still folds
    sf[0, 150, 7] = 108  # row 150: 12 binades: block 1 does not
    sf[1, 383, 0] = 132  # row 383's base rises to 132 over its other bytes' 120: 12 binades, block 2
    sf[2, 128:256] = 87  # block 1's rows: 33 under the expert's largest base (120)
    sf[2, 256:] = 88  # block 2's: 32 under it
    sfk = L.sf_to_kernel_layout(sf)
    _, row_base, _ = L.fast_scales_kernel_layout(sfk)
    fold = L.fold_blocks(sfk, row_base)
    assert fold.dtype == torch.uint8 and fold.tolist() == [[1, 0, 1], [1, 1, 0], [1, 0, 1]]
    # A row count that is not a multiple of 128 (no prefill path then): the last block is partial.
    assert L.fold_blocks(sfk[:, :, :151], row_base[:, :151]).tolist() == [[1, 0], [1, 1], [1, 0]]


def test_the_expert_bases_are_zero_padded_to_whole_4_byte_words():
    # The prefill engine copies the 4-byte word that holds an expert's base byte (cp.async of 4
    # bytes): at E = 6 the word of experts 4-5 ends past them, so the tensor holds 8 bytes.
    sf = torch.full((6, 128, 4), 120, dtype=torch.uint8)
    sf[4, 0, 0] = 131
    _, row_base, expert_base = L.fast_scales_kernel_layout(L.sf_to_kernel_layout(sf))
    assert expert_base.dtype == torch.uint8 and expert_base.tolist() == [120, 120, 120, 120, 131, 120, 0, 0]
    assert row_base.shape == (6, 128)


def test_sizes_in_multiples_of_32_are_padded_in_the_kernel_layout_and_come_back_unpadded():
    # SPEC §8 (gpt-oss's H = I = 2880 at a smaller size): K padded to whole 128-channel blocks with
    # zero codes and scale byte 0, L2's H rows to whole 128-row tiles with zero rows; the canonical
    # weights come back bit for bit.
    from megamoe import reference as ref
    from megamoe.jit.layout import transform_weights, untransform_weights

    w = ref.random_weights(3, 160, 96, seed=4)  # H = 160 = 5 x 32, I = 96 = 3 x 32
    kw = transform_weights(w.w1, w.w1_sf, w.w2, w.w2_sf)
    assert (kw.w1.shape[1] * 128, kw.w1.shape[2] * 16) == (256, 256)  # K 256, rows 2I = 192 -> 256
    assert (kw.w2.shape[1] * 128, kw.w2.shape[2] * 16) == (128, 256)  # K 96 -> 128, rows 160 -> 256
    assert not kw.w2_sf[:, :, 160:].any() and not kw.w1_sf[:, 1, :, 1:].any()  # groups 5-7 of block 1: padding
    for got, want in zip(untransform_weights(kw), (w.w1, w.w1_sf, w.w2, w.w2_sf)):
        assert torch.equal(got, want)


def test_the_scales_derived_at_padded_sizes_are_those_of_the_real_rows():
    # The padding rows (scale byte 0) are no row's spread: the fold blocks and the row spread at
    # H 160, I 96 (rows padded to 256) equal those of the same weights' real rows alone.
    from megamoe import reference as ref
    from megamoe.jit.layout import transform_weights

    w = ref.random_weights(3, 160, 96, seed=4)
    kw = transform_weights(w.w1, w.w1_sf, w.w2, w.w2_sf)
    assert kw.row_spread == max(ref.quantize.weight_row_spread(sf) for sf in (w.w1_sf, w.w2_sf))
    assert kw.row_spread <= ref.quantize.FAST_ROW_SPREAD
    for sf, rows, k, fold in ((kw.w1_sf, 192, 160, kw.w1_fold), (kw.w2_sf, 160, 96, kw.w2_fold)):
        _, base, _ = L.fast_scales_kernel_layout(sf[:, :, :rows])
        assert torch.equal(fold, L.fold_blocks(sf[:, :, :rows], base, k=k))
    # Nor are the K padding's groups (scale byte 0, K 160 -> 256, 96 -> 128) a row's span: scale
    # bytes within 5 binades of each other fold everywhere.
    g = torch.Generator().manual_seed(5)
    for name in ("w1_sf", "w2_sf"):
        t = getattr(w, name)
        t.copy_(torch.randint(115, 121, t.shape, generator=g, dtype=torch.uint8))
    kw = transform_weights(w.w1, w.w1_sf, w.w2, w.w2_sf)
    assert kw.w1_fold.all() and kw.w2_fold.all()
