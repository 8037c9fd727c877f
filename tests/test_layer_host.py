"""The fused layer's and the GEMM entry points' refusals on a machine without a GPU: one line,
a MegaMoEInputError naming the argument as the signature names it (SPEC §7), never a torch
traceback from deep inside."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megamoe import gemm as G
from megamoe import reference as ref
from megamoe.cli import GPT_OSS_MODELS, GPT_OSS_SHAPE
from megamoe.heuristics import choose_engine
from megamoe.jit import build as jb
from megamoe.moe import MegaMoE, kernel_bias
from megamoe.reference import MegaMoEInputError

from .test_gemm_host import _small_call_args

CFG = ref.MoEConfig(hidden=256, intermediate=128, num_experts=4, top_k=2, num_ranks=1, max_tokens_per_rank=16)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


def test_a_layer_given_cpu_weights_says_in_one_line_that_they_must_be_on_a_gpu():
    weights = ref.random_weights(4, 256, 128)
    with pytest.raises(MegaMoEInputError, match=r"argument 'weights': expected a CUDA tensor, got device cpu") as e:
        MegaMoE(CFG, weights)
    if not torch.cuda.is_available():  # the machine lacks the GPU itself, and the message says so
        assert "torch sees no CUDA GPU" in _one_line(e)


def test_a_layer_refuses_a_device_that_is_not_a_gpu_and_arguments_of_the_wrong_type():
    weights = ref.random_weights(4, 256, 128)
    with pytest.raises(MegaMoEInputError, match=r"argument 'device': expected a CUDA device, got cpu"):
        MegaMoE(CFG, weights, device="cpu")
    with pytest.raises(MegaMoEInputError, match=r"argument 'weights': expected ExpertWeights, got dict"):
        MegaMoE(CFG, {"w1": weights.w1})
    with pytest.raises(MegaMoEInputError, match=r"argument 'cfg': expected MoEConfig, got dict"):
        MegaMoE(CFG.to_dict(), weights)
    with pytest.raises(MegaMoEInputError, match=r"argument 'predecoded': expected bool, got str"):
        MegaMoE(CFG, weights, predecoded="yes")


def test_auto_takes_the_prefill_engine_from_its_rows_per_expert_for_every_layer_gpt_oss_included():
    # 128 expected rows an expert (exact mode): gpt-oss-20b (E 32, top-4, H = I = 2880) from T = 1024.
    oai = ref.MoEConfig(
        **GPT_OSS_SHAPE, num_experts=GPT_OSS_MODELS["gpt-oss-20b"], max_tokens_per_rank=4096, activation="swiglu_oai"
    )
    assert choose_engine(oai, "k32", 1000) == "swapab" and choose_engine(oai, "k32", 1024) == "prefill"
    assert choose_engine(oai, "k32", 4096, "swapab") == "swapab"
    plain = ref.MoEConfig(**dict(oai.to_dict(), activation="swiglu"))
    assert choose_engine(plain, "k32", 1024) == "prefill"


def test_a_predecoded_layer_takes_the_prefill_engine_from_32_expected_rows_an_expert_in_the_exact_mode():
    # Without the per-call predecode the prefill engine wins from fewer rows (NOTES v39): gpt-oss-20b
    # from T = 256; the narrow engine keeps its 8 rows, the fast mode its per-call threshold.
    oai = ref.MoEConfig(
        **GPT_OSS_SHAPE, num_experts=GPT_OSS_MODELS["gpt-oss-20b"], max_tokens_per_rank=4096, activation="swiglu_oai"
    )
    assert choose_engine(oai, "k32", 255, predecoded=True) == "swapab"
    assert choose_engine(oai, "k32", 256, predecoded=True) == "prefill"
    assert choose_engine(oai, "k32", 1000, predecoded=True) == "prefill"
    assert choose_engine(oai, "k32", 64, predecoded=True) == "narrow"
    assert choose_engine(oai, "k32", 256, "swapab", predecoded=True) == "swapab"
    fast = ref.MoEConfig(**dict(oai.to_dict(), hidden=512, intermediate=512, activation="swiglu"))
    assert choose_engine(fast, "k128", 1024, predecoded=True) == "swapab"
    assert choose_engine(fast, "k128", 2048, predecoded=True) == "prefill"


def test_auto_takes_the_narrow_engine_up_to_eight_expected_rows_an_expert_in_the_exact_mode_only():
    # gpt-oss-20b: E 32, top-4, so T R / 8 rows an expert: the narrow engine up to T R = 64.
    cfg = ref.MoEConfig(**GPT_OSS_SHAPE, num_experts=32, max_tokens_per_rank=128, activation="swiglu_oai")
    assert [choose_engine(cfg, "k32", t) for t in (1, 8, 64, 65)] == ["narrow", "narrow", "narrow", "swapab"]
    assert choose_engine(cfg, "k128", 8) == "swapab"
    four = ref.MoEConfig(**dict(cfg.to_dict(), num_ranks=4))
    assert choose_engine(four, "k32", 16) == "narrow" and choose_engine(four, "k32", 17) == "swapab"
    with pytest.raises(ValueError, match="engine: promotion 'k128' runs"):
        jb.FusedSpec(promotion="k128", engine="narrow")


def test_a_layer_whose_sizes_the_reference_takes_but_the_kernel_does_not_is_refused_naming_the_size():
    # SPEC §8's sizes in multiples of 32, which the kernel pads inside its layouts; the fast mode keeps
    # its multiples of 512.
    cfg = ref.MoEConfig(**dict(CFG.to_dict(), hidden=2880, intermediate=2880, block_m=64))
    with pytest.raises(MegaMoEInputError, match=r"argument 'cfg.hidden / cfg.intermediate': expected multiples of 512"):
        MegaMoE(cfg, ref.random_weights(4, 2880, 2880), promotion="k128")


def test_the_gemm_entry_points_name_their_own_activation_parameters():
    x, sf, offsets, counts, wr, kw = _small_call_args()
    with pytest.raises(MegaMoEInputError, match=r"argument 'x_pool': expected a CUDA tensor, got device cpu") as e:
        G.l1_gemm(x, sf, offsets, counts, wr, kw)
    _one_line(e)
    with pytest.raises(MegaMoEInputError, match=r"argument 'x_pool': expected a 2-D tensor"):
        G.l1_gemm(x[0], sf, offsets, counts, wr, kw)
    combine = torch.empty(128, 512, dtype=torch.bfloat16)
    acts = torch.zeros(128, 256, dtype=torch.uint8)
    with pytest.raises(MegaMoEInputError, match=r"argument 'l2_acts': expected a CUDA tensor, got device cpu"):
        G.l2_gemm(acts, sf[:, :8].contiguous(), offsets, counts, torch.zeros(128, dtype=torch.int32), kw, combine)


@pytest.mark.parametrize(
    "layer,promotion,match",
    [(1, "k32", "x_sf"), (2, "k32", "l2_sf"), (1, "k128", "x_sf128")],
)
def test_the_gemm_entry_points_name_the_scale_parameter_that_has_the_wrong_shape(layer, promotion, match):
    # Fake CUDA tensors (no GPU needed) reach the shape checks behind the device check.
    *_, kw = _small_call_args()
    k = 512 if layer == 1 else 256
    with FakeTensorMode():
        cuda = dict(device="cuda")
        x = torch.zeros(128, k, dtype=torch.uint8, **cuda)
        bad_sf = torch.zeros(128, 3, dtype=torch.uint8, **cuda)
        offsets = torch.zeros(3, dtype=torch.int32, **cuda)
        counts = torch.zeros(2, dtype=torch.int32, **cuda)
        rebased = dict(x_sf128=bad_sf) if promotion == "k128" else {}
        with pytest.raises(MegaMoEInputError, match=rf"argument '{match}': expected shape"):
            if layer == 1:
                G.prepare_l1_gemm(
                    x, bad_sf, offsets, counts, torch.ones(128, **cuda), kw, promotion=promotion, **rebased
                )
            else:
                dst = torch.zeros(128, dtype=torch.int32, **cuda)
                combine = torch.empty(128, 512, dtype=torch.bfloat16, **cuda)
                G.prepare_l2_gemm(x, bad_sf, offsets, counts, dst, kw, combine, promotion=promotion, **rebased)


def test_withhold_starts_exactly_the_waits_counter_one_short_and_names_a_bad_wait():
    """MegaMoE.withhold (the hang tests' debug switch, SPEC §5), on a stand-in workspace: each wait
    lowers its own counter word by one, and nothing else."""
    import types

    from megamoe.jit import contract as C
    from megamoe.moe import MegaMoE

    def fresh(epoch: int):
        ws = {
            "signals": torch.zeros(2, C.SIGNAL_WORDS, dtype=torch.int32),
            "arrivals": torch.zeros(6, dtype=torch.int32),
            "l1_done": torch.zeros(6, dtype=torch.int32),
            "epoch": torch.tensor([epoch, 0, 0, 0], dtype=torch.int32),
        }
        return types.SimpleNamespace(ws=ws, WITHHOLD=MegaMoE.WITHHOLD, _decoded=None)

    words = {"dispatch": C.SIGNAL_POSTED, "l2_done": C.SIGNAL_L2_DONE, "decoded": C.SIGNAL_DECODED}
    for wait, word in words.items():
        for epoch in (4, 7):  # the next call's parity: epoch & 1
            layer = fresh(epoch)
            MegaMoE.withhold(layer, wait)
            expected = torch.zeros(2, C.SIGNAL_WORDS, dtype=torch.int32)
            expected[epoch & 1, word] = -1
            assert torch.equal(layer.ws["signals"], expected), (wait, epoch)
    for wait, region in (("arrival", "arrivals"), ("l1_done", "l1_done")):
        layer = fresh(0)
        MegaMoE.withhold(layer, wait, 3)
        assert layer.ws[region].tolist() == [0, 0, 0, -1, 0, 0] and not layer.ws["signals"].any()
        with pytest.raises(ref.MegaMoEInputError, match="argument 'index'"):
            MegaMoE.withhold(layer, wait, 6)
    layer = fresh(5)
    MegaMoE.withhold(layer, "epoch")
    assert layer.ws["epoch"][0] == 6 and not layer.ws["signals"].any()
    with pytest.raises(ref.MegaMoEInputError, match="argument 'wait'"):
        MegaMoE.withhold(layer, "grid")
    # A predecoded layer's calls never wait on the predecode counter: that hang cannot be planted.
    layer = fresh(0)
    layer._decoded = (torch.zeros(1), torch.zeros(1))
    with pytest.raises(ref.MegaMoEInputError, match="argument 'wait': expected not 'decoded' on a predecoded layer"):
        MegaMoE.withhold(layer, "decoded")
    assert not layer.ws["signals"].any()


def test_the_kernel_layout_refuses_weights_the_kernels_cannot_take_naming_them():
    w = ref.random_weights(2, 256, 96)  # I = 96: three groups of 32, which the kernel layout pads
    w.w2 = w.w2[:, :, :40]  # I = 80 in w2: not whole groups of 32
    with pytest.raises(MegaMoEInputError, match=r"argument 'w2_sf'|argument 'w2'"):
        G.transform_weights(w.w1, w.w1_sf, w.w2, w.w2_sf)
    w = ref.random_weights(2, 256, 128)
    with pytest.raises(MegaMoEInputError, match=r"argument 'w2_sf': expected dtype torch.uint8"):
        G.transform_weights(w.w1, w.w1_sf, w.w2, w.w2_sf.float())


def test_a_bias_view_off_a_16_byte_boundary_is_copied_for_the_kernels_16_byte_copies():
    # The prefill engine copies b1 / b2 eight columns at a time, 16 bytes by cp.async.
    flat = torch.arange(2 * 64 + 8, dtype=torch.bfloat16)
    for first in (1, 2):  # 2 and 4 bytes past the (64-byte aligned) start
        view = flat[first : first + 128].view(2, 64)
        assert view.data_ptr() % 16 == 2 * first
        b = kernel_bias(view)
        assert b.data_ptr() % 16 == 0 and torch.equal(b, view)
    even = flat[:128].view(2, 64)
    assert kernel_bias(even).data_ptr() == even.data_ptr()  # no copy where none is needed


def test_an_engine_reassigned_on_a_layer_is_checked_against_its_promotion_at_the_call():
    # One workspace serves every engine, so `layer.engine` may change between calls (the GPU tests
    # do); the fast mode has no narrow engine.
    layer = MegaMoE.__new__(MegaMoE)
    layer.cfg = ref.MoEConfig(**GPT_OSS_SHAPE, num_experts=32, max_tokens_per_rank=8)
    layer.promotion, layer.engine, layer._decoded = "k128", "narrow", None
    with pytest.raises(MegaMoEInputError, match=r"argument 'engine': expected one of \('auto', 'swapab', 'prefill'\)"):
        layer.engine_for(8)
    layer.promotion = "k32"
    assert layer.engine_for(8) == "narrow"
    # "auto" asks whether the layer's weights are predecoded (its own prefill threshold).
    layer.engine = "auto"
    assert layer.engine_for(256) == "swapab"
    layer._decoded = (torch.empty(0), torch.empty(0))
    assert layer.engine_for(256) == "prefill"
