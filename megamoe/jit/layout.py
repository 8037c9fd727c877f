"""The SM90 kernel's weight layout: `transform_weights` (SPEC §2) and its exact inverse.

Canonical input (SPEC §2): packed FP4 `w [E, R, K/2]` (byte i = element 2i low nibble, 2i+1 high
nibble) and UE8M0 scale bytes `sf [E, R, K/32]`. For L1, R = 2I with rows [0, I) gate and [I, 2I)
up; for L2, R = H.

Step 1 (L1 only): interleave gate/up rows with granularity 8:
    kernel row r, block b = r // 16, j = r % 16:  j < 8 -> gate row 8b + j,  j >= 8 -> up row 8b + j - 8.
  So a wgmma accumulator's rows g and g + 8 are gate and up of the same intermediate channel.

Step 2 (both layers): re-order and re-encode the FP4 codes so that each consumer thread reads its
wgmma A fragments with two 16-byte shared-memory loads per K128 block, ready for the prmt decode:
    w_k [E, K/128, R/16, 2, 32, 16] uint8   (the last three dims are one 1024-byte block per
                                              16-row group; one K128 stage of a 128-row CTA tile is
                                              8 consecutive such blocks)
  index (e, kb, rg, h, lane, byte): lane = 4g + t; byte = 8 sl + 4 hk + (0..3) holds the 32-bit
  word of k32 step s = 2h + sl, half hk (k offset 16 hk), encoding the two fragment registers
      Ra = row 16 rg + g,     k = 128 kb + 32 s + 16 hk + 4 t + i   (i = 0..3)
      Rb = row 16 rg + g + 8, same k
  word bits: nibble i (0..3) low 3 bits = |code| of Ra_i, nibble 4 + i low 3 bits = |code| of Rb_i,
  bit 8i + 3 = sign of Ra_i, bit 8i + 7 = sign of Rb_i (kernel/gemm/fp4_decode.cuh).
    sf_k [E, K/128, R, 4] uint8: the four K32 scale bytes of (row, K128 block), contiguous.
The scale bytes are unchanged (exact mode applies them in fp32). Both steps are permutations of
bits, so `untransform_weights` restores the canonical tensors bit for bit.

Step 3, the fast mode's (promotion k128) scale tensors, derived from sf_k (fast_scales_kernel_layout):
    lut [E, K/128, R, 4] uint8: 8 * min(B_r - s_g, 19), the byte offset of group g's scaled table
    row_base [E, R] uint8: B_r, the row's largest scale byte; expert_base [E4] uint8: max_r B_r,
    zero past E to whole 4-byte words (E4 = E rounded up to a multiple of 4: the prefill engine
    copies the word that holds an expert's byte).
The exact mode's (promotion k32) prefill path uses them too (fold_blocks):
    fold [E, ceil(R/128)] uint8: 1 where every row of the 128-row block has all its scale bytes
    within FOLD_BINADES (11) of its row base, and that within FOLD_ROW_SPREAD (32) of B_e.
"""

from __future__ import annotations

import dataclasses

import torch

# Step 1 and the nibble packing have one definition, in the reference.
from megamoe.jit import contract
from megamoe.reference import quantize as Q
from megamoe.reference.errors import check_tensor, fail
from megamoe.reference.formats import pack_fp4, unpack_fp4
from megamoe.reference.weights import deinterleave_gate_up, interleave_gate_up  # noqa: F401


def fp4_to_kernel_layout(packed: torch.Tensor) -> torch.Tensor:
    """[E, R, K/2] canonical packed FP4 -> [E, K/128, R/16, 1024] kernel layout (step 2). One expert
    at a time: the bit packing's int64 intermediates take ~40 bytes a weight, and a whole layer at
    once (DeepSeek-V3's L1 slice, 32 x 4096 x 7168 weights) ran an 80 GB GPU out of memory beside
    the test suite's other workers (bench/NOTES.md v44)."""
    E, R, K2 = packed.shape
    K = 2 * K2
    assert R % 16 == 0 and K % 128 == 0
    if E > 1:
        return torch.cat([fp4_to_kernel_layout(packed[e : e + 1]) for e in range(E)])
    codes = unpack_fp4(packed).to(torch.int64)  # [E, R, K]
    # (e, rg, rh, g, kb, h, sl, hk, t, i) -> (e, kb, rg, h, g, t, sl, hk, rh, i)
    c = codes.view(E, R // 16, 2, 8, K // 128, 2, 2, 2, 4, 4).permute(0, 4, 1, 5, 3, 8, 6, 7, 2, 9)
    mag = c & 7
    sgn = c >> 3
    sh = torch.arange(4, device=packed.device)
    word = (
        (mag[..., 0, :] << (4 * sh)).sum(-1)
        + (mag[..., 1, :] << (16 + 4 * sh)).sum(-1)
        + (sgn[..., 0, :] << (8 * sh + 3)).sum(-1)
        + (sgn[..., 1, :] << (8 * sh + 7)).sum(-1)
    )
    # word: [E, KB, RG, 2(h), 8(g), 4(t), 2(sl), 2(hk)] -> little-endian bytes
    b = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)
    return b.reshape(E, K // 128, R // 16, 1024).contiguous()


def fp4_from_kernel_layout(wk: torch.Tensor, R: int, K: int) -> torch.Tensor:
    """Inverse of fp4_to_kernel_layout: [E, K/128, R/16, 1024] -> [E, R, K/2], one expert at a time
    (its int64 intermediates, as there)."""
    E = wk.shape[0]
    if E > 1:
        return torch.cat([fp4_from_kernel_layout(wk[e : e + 1], R, K) for e in range(E)])
    b = wk.view(E, K // 128, R // 16, 2, 8, 4, 2, 2, 4).to(torch.int64)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    sh = torch.arange(4, device=wk.device)
    w = word.unsqueeze(-1)
    mag_a = (w >> (4 * sh)) & 7
    mag_b = (w >> (16 + 4 * sh)) & 7
    sgn_a = (w >> (8 * sh + 3)) & 1
    sgn_b = (w >> (8 * sh + 7)) & 1
    ca = mag_a | (sgn_a << 3)
    cb = mag_b | (sgn_b << 3)
    c = torch.stack([ca, cb], dim=-2)  # (e, kb, rg, h, g, t, sl, hk, rh, i)
    c = c.permute(0, 2, 8, 4, 1, 3, 6, 7, 5, 9)  # -> (e, rg, rh, g, kb, h, sl, hk, t, i)
    codes = c.reshape(E, R, K)
    return pack_fp4(codes.to(torch.uint8))


def sf_to_kernel_layout(sf: torch.Tensor) -> torch.Tensor:
    """[E, R, K/32] -> [E, K/128, R, 4]."""
    E, R, G = sf.shape
    return sf.view(E, R, G // 4, 4).permute(0, 2, 1, 3).contiguous()


def sf_from_kernel_layout(sfk: torch.Tensor) -> torch.Tensor:
    E, KB, R, _ = sfk.shape
    return sfk.permute(0, 2, 1, 3).reshape(E, R, KB * 4).contiguous()


def fast_scales_kernel_layout(sfk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fast mode's (promotion k128) view of kernel-layout scale bytes [E, K/128, R, 4], by the
    reference's rule (megamoe.reference.quantize.fast_weight_scales): LUT byte offsets 8 d in the
    same layout, the row bases B_r [E, R] and each expert's largest row base B_e [E4] (zeros past E
    to whole 4-byte words: kernel/epilogue/prefill_rows.cuh prefill_item_fetch)."""
    sf = sfk.to(torch.int32)
    row_base = sf.amax(dim=(1, 3))  # [E, R]
    d = (row_base[:, None, :, None] - sf).clamp(max=Q.FAST_LUT_ENTRIES - 1)
    expert_base = torch.nn.functional.pad(row_base.amax(dim=1), (0, -row_base.shape[0] % 4))
    return (8 * d).to(torch.uint8), row_base.to(torch.uint8), expert_base.to(torch.uint8)


# The exact mode's prefill path folds a block's weight scales into its predecoded bytes where every
# row's scale bytes lie within FOLD_BINADES of its base, and the row's base within FOLD_ROW_SPREAD of
# its expert's. The scaled tables are exact to 14 binades (Q.FAST_EXACT_BINADES), but measured on
# the H200 the tensor core's k32 sums then change: with spans of 13 and 14, 29 and 1223 of 444416
# accumulators differed from the two-scale promotion's (up to 2^-11 relative), with spans up to 12
# none did (bench/NOTES.md v18). The differences came with E4M3-subnormal weights, which the tables
# give from d = 12 on (0.5 x 2^-6); at 11 every folded weight is a normal E4M3 value, as every
# weight of the two-scale path is. The row spread bounds the folded accumulator, the two-scale one
# times 2^(B_e - B_r): it overflows only where the result exceeds 2^(128 - 32).
FOLD_BINADES = 11
FOLD_ROW_SPREAD = 32


def fold_blocks(
    sfk: torch.Tensor, row_base: torch.Tensor, rows: int | None = None, k: int | None = None
) -> torch.Tensor:
    """[E, ceil(R/128)] uint8: 1 where every row of the 128-row block (the exact mode's prefill tile,
    contract.PREFILL_ROWS["k32"]) has all its scale bytes within FOLD_BINADES of its row base B_r and B_r
    within FOLD_ROW_SPREAD of the expert's largest B_e. There the exact mode's prefill path
    predecodes the weights through the fast mode's scaled tables and promotes each k32 product with
    one FMA; other blocks take the two-scale promotion (gemm_sm90_prefill.cuh). `rows` and `k`: the
    real rows (2I or H) and K (H or I); the rest is the layout's zero padding (zero codes, scale
    byte 0), which any fold leaves zero and which is no row's span."""
    base = row_base.to(torch.int32)
    groups = sfk.to(torch.int32)  # [E, K/128, R, 4]
    if k is not None:  # the K padding's groups (scale byte 0) out of the minimum
        kg = torch.arange(sfk.shape[1] * 4, device=sfk.device).view(sfk.shape[1], 1, 4) < k // 32
        groups = torch.where(kg, groups, torch.iinfo(torch.int32).max)
    span = base - groups.amin(dim=(1, 3))  # [E, R]
    ok = (span <= FOLD_BINADES) & (base.amax(dim=1, keepdim=True) - base <= FOLD_ROW_SPREAD)
    if rows is not None:
        ok[:, rows:] = True
    E, R = ok.shape
    rows_per_block = contract.PREFILL_ROWS["k32"]
    blocks = prefill_blocks(R, "k32")
    ok = torch.nn.functional.pad(ok, (0, blocks * rows_per_block - R), value=True)
    return ok.view(E, blocks, rows_per_block).all(dim=2).to(torch.uint8)


@dataclasses.dataclass
class KernelWeights:
    """Both layers' weights in the SM90 kernel layout (see the module docstring). The fast mode's
    tensors (w*_lut, w*_row_base, w*_expert_base) and the exact prefill's w*_fold are derived from
    the scale bytes when the object is made: a function of them, so the canonical weights stay
    recoverable (untransform_weights)."""

    # (H_pad, I_pad: contract.padded_k; R1, R2: padded_rows of 2I and H; all equal the sizes for
    # multiples of 128)
    w1: torch.Tensor  # [E, H_pad/128, R1/16, 1024] uint8 (gate/up interleaved)
    w1_sf: torch.Tensor  # [E, H_pad/128, R1, 4] uint8
    w2: torch.Tensor  # [E, I_pad/128, R2/16, 1024] uint8
    w2_sf: torch.Tensor  # [E, I_pad/128, R2, 4] uint8
    hidden: int
    intermediate: int
    w1_lut: torch.Tensor = dataclasses.field(init=False)  # [E, H_pad/128, R1, 4] uint8, 8 d
    w1_row_base: torch.Tensor = dataclasses.field(init=False)  # [E, R1] uint8
    w1_expert_base: torch.Tensor = dataclasses.field(init=False)  # [E4] uint8 (E to whole words)
    w2_lut: torch.Tensor = dataclasses.field(init=False)
    w2_row_base: torch.Tensor = dataclasses.field(init=False)
    w2_expert_base: torch.Tensor = dataclasses.field(init=False)
    w1_fold: torch.Tensor = dataclasses.field(init=False)  # [E, ceil(R1/256)] uint8 (fold_blocks)
    w2_fold: torch.Tensor = dataclasses.field(init=False)  # [E, ceil(R2/256)] uint8
    row_spread: int = dataclasses.field(init=False)  # max B_e - B_r over both layers (FAST_ROW_SPREAD)

    def __post_init__(self):
        self.w1_lut, self.w1_row_base, self.w1_expert_base = fast_scales_kernel_layout(self.w1_sf)
        self.w2_lut, self.w2_row_base, self.w2_expert_base = fast_scales_kernel_layout(self.w2_sf)
        # Over the real rows only: a padding row's base (0) is no row's spread (the expert bases
        # are unchanged by it: 0 is no maximum unless the whole expert is zero).
        real1, real2 = 2 * self.intermediate, self.hidden
        self.w1_fold = fold_blocks(self.w1_sf, self.w1_row_base, real1, self.hidden)
        self.w2_fold = fold_blocks(self.w2_sf, self.w2_row_base, real2, self.intermediate)
        self.row_spread = max(
            int((eb[: rb.shape[0], None].int() - rb[:, :real].int()).max()) if rb.numel() else 0
            for eb, rb, real in (
                (self.w1_expert_base, self.w1_row_base, real1),
                (self.w2_expert_base, self.w2_row_base, real2),
            )
        )

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]


# Weight rows padded to whole row tiles of the exact mode's swap-AB kernels (two consumer warpgroups
# of contract.ROWS_PER_WG rows), where a size is not a multiple of 128 (SPEC §8): L1's 2I
# interleaved gate/up rows, L2's H.
ROW_TILE = 2 * contract.ROWS_PER_WG


def padded_rows(rows: int) -> int:
    """A layer's weight rows in the kernel layout: `rows` (2I or H) padded to whole ROW_TILE tiles."""
    return -(-rows // ROW_TILE) * ROW_TILE


def prefill_blocks(layout_rows: int, promotion: str) -> int:
    """The prefill kernel's blocks of contract.PREFILL_ROWS[promotion] weight rows over a layer's rows
    in the kernel layout (padded_rows; the kernel's prefill_blocks, kernel/gemm/predecode.cuh): its
    fold flags' and predecoded tiles' count. Whole: the exact mode's blocks are one row tile, the fast
    mode's sizes multiples of 512; a part is counted as a block all the same."""
    return -(-layout_rows // contract.PREFILL_ROWS[promotion])


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`t` with dimension `dim` zero-padded at its end to `size` (zero FP4 codes, scale byte 0)."""
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def transform_weights(w1: torch.Tensor, w1_sf: torch.Tensor, w2: torch.Tensor, w2_sf: torch.Tensor) -> KernelWeights:
    """Canonical SPEC §2 weights -> the kernel layout (gate/up interleave + fragment order). The
    kernels' K block is 128 channels: H and I that are multiples of 32 only (SPEC §8) are padded to
    whole K blocks (contract.padded_k) with zero codes and scale byte 0, and
    both layers' rows (2I interleaved, H) to whole row tiles (padded_rows) with zero rows; the
    padding is the layout's."""
    check_tensor("w1", w1, torch.uint8, (None, None, None))
    E, R1, H2 = w1.shape
    H = 2 * H2
    inter = R1 // 2
    for name, k in (("w1", H), ("w2", inter)):
        if k == 0 or k % 32 or (name == "w1" and R1 % 2):
            what = "H" if name == "w1" else "I"
            fail(name, f"{what} a positive multiple of 32 (the scale groups)", f"{what} = {k}")
    check_tensor("w1_sf", w1_sf, torch.uint8, (E, R1, H // 32), w1.device)
    check_tensor("w2", w2, torch.uint8, (E, H, inter // 2), w1.device)
    check_tensor("w2_sf", w2_sf, torch.uint8, (E, H, inter // 32), w1.device)
    h_pad, i_pad, rows1, rows2 = contract.padded_k(H), contract.padded_k(inter), padded_rows(R1), padded_rows(H)
    w1i = _pad(_pad(interleave_gate_up(w1), 2, h_pad // 2), 1, rows1)
    s1i = _pad(_pad(interleave_gate_up(w1_sf), 2, h_pad // 32), 1, rows1)
    w2p = _pad(_pad(w2, 2, i_pad // 2), 1, rows2)
    s2p = _pad(_pad(w2_sf, 2, i_pad // 32), 1, w2p.shape[1])
    return KernelWeights(
        fp4_to_kernel_layout(w1i),
        sf_to_kernel_layout(s1i),
        fp4_to_kernel_layout(w2p),
        sf_to_kernel_layout(s2p),
        H,
        inter,
    )


def untransform_weights(kw: KernelWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    H, inter = kw.hidden, kw.intermediate
    h_pad, i_pad, rows1, rows2 = kw.w1.shape[1] * 128, kw.w2.shape[1] * 128, kw.w1.shape[2] * 16, kw.w2.shape[2] * 16
    w1 = deinterleave_gate_up(fp4_from_kernel_layout(kw.w1, rows1, h_pad)[:, : 2 * inter, : H // 2])
    s1 = deinterleave_gate_up(sf_from_kernel_layout(kw.w1_sf)[:, : 2 * inter, : H // 32])
    w2 = fp4_from_kernel_layout(kw.w2, rows2, i_pad)[:, :H, : inter // 2].contiguous()
    s2 = sf_from_kernel_layout(kw.w2_sf)[:, :H, : inter // 32].contiguous()
    return w1, s1, w2, s2
