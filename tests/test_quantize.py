"""The three per-32 quantizers of SPEC §1 and their dequantizers."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from megamoe import reference as ref
from megamoe.reference import formats as F
from megamoe.reference import quantize as Q


def _expected_group(values: np.ndarray, max_elem: float, fmt, floor: float | None, clamp: bool):
    """The rule written the slow way: ceil(log2(amax * fp32(1/max))) and an ml_dtypes cast."""
    mag = np.where(np.isnan(values), 0, np.abs(values)).astype(np.float32)
    amax = np.float32(mag.max())
    if floor is not None:
        amax = max(amax, np.float32(floor))
    scaled = np.float32(amax) * np.float32(1.0 / max_elem)
    e = -127 if scaled == 0 else math.ceil(math.log2(float(scaled)))
    if clamp:
        e = min(max(e, -126), 127)
    payload = (values.astype(np.float32) * np.float32(2.0**-e)).clip(-max_elem, max_elem)
    return e + 127, payload.astype(fmt).view(np.uint8)


def test_activations_match_the_rule_written_out():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=g).float())
    q = ref.quantize_activations(x)
    assert q.codes.shape == (64, 256) and q.scales.shape == (64, 8)
    xn = x.numpy()
    for t in range(0, 64, 7):
        for grp in range(8):
            byte, payload = _expected_group(xn[t, 32 * grp : 32 * grp + 32], 448, ml_dtypes.float8_e4m3fn, 1e-4, True)
            assert q.scales[t, grp].item() == byte
            assert q.codes[t, 32 * grp : 32 * grp + 32].numpy().tolist() == payload.tolist()


def test_activation_zero_group_uses_the_floor_and_byte_clamp():
    x = torch.zeros(2, 64)
    x[1, 32:] = 1e38
    q = ref.quantize_activations(x)
    floor_byte = math.ceil(math.log2(float(np.float32(1e-4) * np.float32(1 / 448)))) + 127
    assert q.scales[0].tolist() == [floor_byte, floor_byte]
    assert (q.codes[0] == 0).all()
    assert 1 <= q.scales.min() and q.scales.max() <= 254


def test_weights_quantizer_packs_fp4_and_rejects_non_finite():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 16, 64, generator=g) / 8
    q = ref.quantize_weights(w)
    assert q.codes.shape == (2, 16, 32) and q.scales.shape == (2, 16, 2)
    deq = ref.dequantize_fp4(q.codes, q.scales)
    # RCEIL never saturates: the error is at most half an E2M1 step at the group scale (step <= 2^e).
    step = ref.decode_ue8m0(q.scales, torch.float64).repeat_interleave(32, -1)
    assert ((deq - w.double()).abs() <= step + 1e-12).all()
    w[1, 3, 5] = float("nan")
    with pytest.raises(ValueError, match="argument 'w'"):
        ref.quantize_weights(w)


def test_intermediate_requant_zero_group_is_byte_0_and_no_clamp():
    a = torch.zeros(1, 96)
    a[0, 32:64] = 1e-30  # tiny: below the host floor, kept exactly as the kernel does
    a[0, 64:] = 3.0e38
    q = ref.requantize_intermediate(a)
    assert q.scales[0, 0].item() == 0 and (q.codes[0, :32] == 0).all()
    assert q.scales[0, 1].item() == math.ceil(math.log2(float(np.float32(1e-30) * np.float32(1 / 448)))) + 127
    assert q.scales[0, 2].item() == math.ceil(math.log2(float(np.float32(3e38) * np.float32(1 / 448)))) + 127
    back = ref.dequantize_e4m3(q.codes, q.scales)
    assert torch.allclose(back[0, 32:], a[0, 32:].double(), rtol=2**-4)


def test_nan_element_keeps_its_group_scale_and_becomes_0x7f():
    x = torch.ones(1, 32)
    x[0, 3] = float("nan")
    for quantize in (ref.quantize_activations, ref.requantize_intermediate):
        q = quantize(x)
        assert q.codes[0, 3].item() == 0x7F
        assert q.scales[0, 0].item() == math.ceil(math.log2(float(np.float32(1 / 448)))) + 127


def test_e4m3_dequantize_is_exact():
    codes = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    scales = torch.tensor([[0], [1], [100], [127], [128], [200], [254], [5]], dtype=torch.uint8)
    deq = ref.dequantize_e4m3(codes, scales)
    want = ref.decode_e4m3(codes).double() * torch.exp2(scales.double() - 127)
    assert torch.equal(torch.isnan(deq), torch.isnan(want))
    assert torch.equal(deq.nan_to_num(), want.nan_to_num())


def test_make_inputs_quantizes_on_the_device_it_is_asked_for(monkeypatch):
    # The draws are the CPU generator's (the same numbers everywhere); the quantizer is a stage of
    # the device-agnostic reference and must run where the inputs are asked for, not on the CPU
    # before a copy. The meta device shows where it ran without a GPU.
    from megamoe.reference import inputs as I

    seen = []

    def recording(x):
        seen.append(x.device.type)
        return ref.quantize_activations(x)

    monkeypatch.setattr(I, "quantize_activations", recording)
    cfg = ref.MoEConfig(hidden=256, intermediate=128, num_experts=4, top_k=2, num_ranks=2, max_tokens_per_rank=8)
    got = ref.make_inputs(cfg, 8, device="meta")
    assert seen == ["meta", "meta"]
    assert {t.device.type for inp in got for t in (inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)} == {"meta"}


def test_the_quantizers_and_the_fast_operand_compute_on_their_inputs_device():
    # Every op of theirs runs where the input is (a CPU step would give a CPU tensor or fail on meta).
    x = torch.empty(4, 128, device="meta")
    codes = torch.empty(4, 128, dtype=torch.uint8, device="meta")
    packed = torch.empty(4, 64, dtype=torch.uint8, device="meta")
    sf = torch.empty(4, 4, dtype=torch.uint8, device="meta")
    outs = [
        *ref.quantize_activations(x),
        *ref.requantize_intermediate(x),
        *ref.rebase_k128(codes, sf),
        ref.dequantize_e4m3(codes, sf),
        ref.dequantize_fp4(packed, sf),
        Q.dequantize_fp4_fast(packed, sf),
        Q.scaled_fp4_lut("meta"),
    ]
    assert {t.device.type for t in outs} == {"meta"}


# ---------------------------------------------------------------------------------------------
# rebase_k128: torch's casts, proven against the codecs on its whole input domain
# ---------------------------------------------------------------------------------------------
def _every_code_at_every_shift(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [255, 384], scale bytes [255, 12] and each group's shift [255, 12]: row d holds the 256
    E4M3 codes (NaNs 0x7F and 0xFF included) in groups 1-3 of three K128 blocks, whose bytes are
    254 - d under group 0's 254, so every code meets every shift 0 .. -254 valid bytes can make
    (past -149, where the factor is 0)."""
    slots = torch.zeros(3 * 3 * 32, dtype=torch.uint8)
    slots[:256] = torch.arange(256, dtype=torch.uint8)
    blocks = torch.zeros(3, 4, 32, dtype=torch.uint8)
    blocks[:, 1:] = slots.reshape(3, 3, 32)
    d = torch.arange(255, dtype=torch.int32)
    shift = torch.zeros(255, 3, 4, dtype=torch.int32)
    shift[:, :, 1:] = -d[:, None, None]
    codes = blocks.reshape(1, 384).repeat(255, 1)
    return codes.to(device), (254 + shift).reshape(255, 12).to(torch.uint8).to(device), shift.reshape(255, 12)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
)
def test_rebase_k128_is_the_codecs_rule_for_every_code_at_every_shift(device):
    codes, sf, shift = _every_code_at_every_shift(device)
    got = ref.rebase_k128(codes, sf)
    # SPEC §3 D4 with the codecs: e4m3_satfinite(RNE(value * 2^shift)) in fp32, 0 below 2^-149.
    factor = torch.where(shift < -149, 0.0, torch.exp2(shift.double())).to(torch.float32)
    values = ref.decode_e4m3(codes.cpu()).reshape(255, 12, 32) * factor[..., None]
    want = ref.encode_e4m3(values.reshape(255, 384))
    assert torch.equal(got.scales.cpu(), torch.full((255, 3), 254, dtype=torch.uint8))
    assert torch.equal(got.codes.cpu(), want)
    # The NaNs: both codes become 0x7F at every shift (torch's cast alone keeps 0xFF's sign).
    nan = (codes == 0x7F) | (codes == 0xFF)
    assert int(nan.sum()) == 2 * 255 and bool((got.codes[nan] == 0x7F).all())


def test_rebase_k128_reads_no_host_tensor_so_a_cuda_graph_can_capture_it():
    # On the meta device every op must take its tensors from there: a table copied from the host on
    # each call (what the codecs' decode_e4m3 does) is an op with a CPU input, which graph capture
    # refuses. tests/gpu/test_reference_gpu.py captures it on a GPU.
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostInputs(TorchDispatchMode):
        seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = [*args, *(kwargs or {}).values()]
            self.seen += [str(func) for a in flat if isinstance(a, torch.Tensor) and a.device.type != "meta"]
            return func(*args, **(kwargs or {}))

    codes = torch.empty(4, 256, dtype=torch.uint8, device="meta")
    sf = torch.empty(4, 8, dtype=torch.uint8, device="meta")
    with HostInputs() as mode:
        ref.rebase_k128(codes, sf)
        ref.decode_e4m3(codes)  # the check itself sees a host table
    assert mode.seen == ["aten._to_copy.default"]


def test_the_fast_weight_operand_follows_its_table_rule_at_every_spread_beyond_the_last_entry_too():
    """SPEC §3 D5, the fast mode's weights: group g of a row, d = B_r - s_g binades under the row's
    largest, is m * 2^(s_g - 127) exactly up to d = 14, RNE onto E4M3's grid at 2^(B_r - 142) from
    15 to 18, and 0 (of the code's sign) from 19 on, out to d = 40 (the fuzzer's wide spreads)."""
    base, spreads = 200, list(range(41)) + [41, 42, 43]  # 44 groups: K = 1408, a multiple of 128
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # every E2M1 code twice per group
    row = torch.cat([codes for _ in spreads])[None]
    packed = F.pack_fp4(row)
    sf = torch.tensor([[base - d for d in spreads]], dtype=torch.uint8)
    got = Q.dequantize_fp4_fast(packed, sf)[0].view(len(spreads), 32)
    mags = F.decode_e2m1(codes).to(torch.float64)
    for g, d in enumerate(spreads):
        if d <= 14:
            want = mags * 2.0 ** (base - d - 127)
        elif d <= 18:
            grid = 2.0 ** (base - 127 - 6 - 9)  # E4M3's subnormal step, times the row's factor
            want = torch.round(mags * 2.0 ** (base - d - 127) / grid) * grid  # |m 2^(6-d)| < 2^-6: subnormal
        else:
            want = mags * 0.0
        assert torch.equal(got[g], want), (d, got[g].tolist(), want.tolist())
        assert torch.equal(torch.signbit(got[g]), torch.signbit(mags)), d
