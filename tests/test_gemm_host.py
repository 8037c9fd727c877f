"""The GEMM entry points' host side, on the CPU: SPEC §7 errors (MegaMoEInputError, still a
TypeError / ValueError) before anything is launched, the activation clamp's validation and bf16
rounding, the token-tile choice, one build per specialisation however many workers ask, and the
GPU-only tools saying so instead of a traceback."""

import dataclasses
import subprocess
import sys
import threading
import time

import pytest
import torch

from megamoe import gemm as G
from megamoe import heuristics
from megamoe import launch as LA
from megamoe import runtime
from megamoe.jit import build as jb
from megamoe.jit import layout as L
from megamoe import reference as ref
from megamoe.reference import MegaMoEInputError


def _small_call_args(device="cpu"):
    E, H, inter, P = 2, 512, 256, 128
    g = torch.Generator().manual_seed(0)
    w1 = torch.randint(0, 256, (E, 2 * inter, H // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    s1 = torch.full((E, 2 * inter, H // 32), 120, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (E, H, inter // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    s2 = torch.full((E, H, inter // 32), 120, dtype=torch.uint8)
    kw = L.transform_weights(w1, s1, w2, s2)
    x = torch.zeros(P, H, dtype=torch.uint8, device=device)
    sf = torch.full((P, H // 32), 127, dtype=torch.uint8, device=device)
    offsets = torch.tensor([0, 64, 128], dtype=torch.int32, device=device)
    counts = torch.tensor([10, 20], dtype=torch.int32, device=device)
    return x, sf, offsets, counts, torch.ones(P, device=device), kw


def test_l1_gemm_on_cpu_tensors_raises_the_spec_error_naming_the_argument():
    x, sf, offsets, counts, wr, kw = _small_call_args()
    with pytest.raises(MegaMoEInputError, match="argument 'x_pool': expected a CUDA tensor"):
        G.l1_gemm(x, sf, offsets, counts, wr, kw)
    assert issubclass(MegaMoEInputError, TypeError) and issubclass(MegaMoEInputError, ValueError)


def test_a_prepared_call_checks_its_arguments_like_the_entry_point_before_anything_is_made():
    x, sf, offsets, counts, wr, kw = _small_call_args()
    with pytest.raises(MegaMoEInputError, match="argument 'x_pool': expected a CUDA tensor"):
        G.prepare_l1_gemm(x, sf, offsets, counts, wr, kw)
    with pytest.raises(TypeError, match="fast_maths"):
        G.prepare_l1_gemm(x, sf, offsets, counts, wr, kw, fast_maths=True)
    with pytest.raises(TypeError, match="combine"):
        G.prepare_l2_gemm(x, sf, offsets, counts, wr, kw)


@pytest.mark.parametrize("prepare", [G.prepare_l1_gemm, G.prepare_l2_gemm])
def test_a_prepared_call_refuses_what_only_the_entry_point_does_per_call(prepare):
    x, sf, offsets, counts, wr, kw = _small_call_args()
    args = (x, sf, offsets, counts, wr, kw) + (
        (torch.empty(128, 512, dtype=torch.bfloat16),) if prepare is G.prepare_l2_gemm else ()
    )
    with pytest.raises(MegaMoEInputError, match="argument 'debug': expected False for a prepared call"):
        prepare(*args, debug=True)
    with pytest.raises(MegaMoEInputError, match="argument 'x_sf128': expected the rebased operand"):
        prepare(*args, promotion="k128")


@pytest.mark.parametrize("geometry", [(2**31, 128, 0), (0, 128, 0), (132, 2048, 0), (132, 128, 2**31)])
def test_a_launch_geometry_the_untyped_driver_call_would_truncate_is_refused(geometry):
    from megamoe.jit import driver

    with pytest.raises(ValueError, match="launch geometry out of range"):
        driver.Launch(None, *geometry, b"")


def test_an_unknown_promotion_or_tile_is_refused():
    with pytest.raises(MegaMoEInputError, match="'promotion'"):
        G.spec_for(1, promotion="fast")
    with pytest.raises(MegaMoEInputError, match="'max_tile'"):
        G.spec_for(1, promotion="k128", max_tile=96)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "1.5", True, [1.0]])
def test_activation_clamp_must_be_a_positive_number(bad):
    with pytest.raises(MegaMoEInputError, match="activation_clamp"):
        LA.clamp(bad)


def test_activation_clamp_is_rounded_to_bf16_like_the_reference():
    from megamoe.reference.formats import round_bf16

    for c in (1.0, 1.00390625, 1.0039, 7.3, 1e-3, 3e38):
        want = float(round_bf16(torch.tensor([c], dtype=torch.float32))[0])
        assert LA.clamp(c) == (want, 1)
    assert LA.clamp(None) == (0.0, 0)


def test_the_largest_tile_holds_the_largest_expert_and_skewed_launches_take_64():
    assert G.pick_max_tile(8) == 8 and G.pick_max_tile(9) == 16 and G.pick_max_tile(100) == 128
    assert G.pick_max_tile(200) == 256 and G.pick_max_tile(5000) == 256 and G.pick_max_tile(None) == 256
    assert G.pick_max_tile(5000, "k32") == 64
    assert G.pick_max_tile(100, rows_per_expert=64.0) == 64  # zipf: most experts are small
    assert G.pick_max_tile(600, rows_per_expert=576.0) == 256  # uniform prefill
    assert G.spec_for(1, max_tokens=8, n_rows=4096).wgs == 4 and G.spec_for(1, max_tokens=9, n_rows=4096).wgs == 2
    # the fast mode keeps four consumer warpgroups up to 64 tokens (one serial mainloop), where the
    # weight rows fill 256-row CTAs
    assert G.spec_for(1, promotion="k128", max_tokens=64, n_rows=4096).wgs == 4
    assert G.spec_for(1, promotion="k128", max_tokens=65, n_rows=4096).wgs == 2
    assert G.spec_for(2, promotion="k128", max_tokens=64, n_rows=128 * 3).wgs == 2


def test_concurrent_builds_of_one_specialisation_compile_it_once(tmp_path, monkeypatch):
    """pytest-xdist workers share the compile gate's cache: the second asker waits on the lock."""
    monkeypatch.setenv("MEGAMOE_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_compile(spec, out, log):
        calls.append(spec)
        time.sleep(0.2)
        out.write_bytes(b"cubin")
        log.write_text("log")
        return jb.Built(out, "log", False)

    monkeypatch.setattr(jb, "_compile", fake_compile)
    spec = jb.GemmSpec(layer=1, max_tile=16, promotion="k32")
    results = []
    threads = [threading.Thread(target=lambda: results.append(jb.build(spec))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 3 and sum(r.cached for r in results) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("module", ["bench.gemm", "bench.profile_one", "bench.host_probe", "tests.gpu.record_fixtures"])
def test_gpu_only_tools_say_they_need_a_gpu(module, tmp_path):
    args = {"bench.profile_one": ["1", "8", "k128"], "tests.gpu.record_fixtures": [str(tmp_path)]}.get(module, [])
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_the_prefill_path_is_taken_from_the_measured_crossovers_for_the_largest_and_the_mean_expert():
    assert G.PREFILL_MIN_TOKENS == {("k128", 1): 512, ("k128", 2): 512, ("k32", 1): 65, ("k32", 2): 65}
    assert G.PREFILL_MIN_MEAN_ROWS == {("k128", 1): 512, ("k128", 2): 512, ("k32", 1): 128, ("k32", 2): 128}
    assert G.use_prefill(1, 512, 520.0, "k128", 4096) and not G.use_prefill(1, 511, 520.0, "k128", 4096)
    assert G.use_prefill(2, 512, 515.0, "k128", 7168) and not G.use_prefill(2, 511, 515.0, "k128", 7168)
    assert not G.use_prefill(2, 512, 500.0, "k128", 7168)  # the mean below the crossover
    assert not G.use_prefill(1, 676, 66.0, "k128", 4096)  # a skewed routing: the pass decodes every expert
    assert not G.use_prefill(1, None, 520.0, "k128", 4096)  # unknown largest expert
    # The exact mode: from 65 tokens (past its swap-AB kernel's largest tile), where the pool's mean
    # is two blocks of 64 per expert (uniform 65 pads to 128); not the Zipf routing of 8 tokens.
    assert G.use_prefill(1, 65, 130.0, "k32", 4096) and not G.use_prefill(1, 64, 130.0, "k32", 4096)
    assert not G.use_prefill(1, 100, 68.0, "k32", 4096) and not G.use_prefill(1, 676, 104.0, "k32", 4096)
    assert not G.use_prefill(1, 4096, 4096.0, "k64", 4096)  # no such promotion: no prefill path
    assert not G.use_prefill(1, 4096, 4096.0, "k128", 4096 + 128)  # rows not a multiple of 256
    # Without a caller's choice: the automatic one, unless a gate or a forced specialisation says otherwise.
    auto = dict(max_tokens=600, rows_per_expert=600.0, promotion="k128", n_rows=4096)
    assert heuristics.prefill_path(1, None, arrival=None, max_tile=None, wgs=None, **auto)
    assert not heuristics.prefill_path(1, None, arrival=object(), max_tile=None, wgs=None, **auto)
    assert not heuristics.prefill_path(1, None, arrival=None, max_tile=64, wgs=None, **auto)
    assert not heuristics.prefill_path(1, False, arrival=None, max_tile=None, wgs=None, **auto)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(n_rows=4096 + 128), "multiple of 256"),
        (dict(arrival=object()), "arrival gate"),
        (dict(max_tile=64), "max_tile"),
        (dict(wgs=4), "max_tile / wgs"),
    ],
)
def test_a_forced_prefill_path_the_launch_cannot_take_is_an_input_error(change, match):
    args = dict(
        max_tokens=600, rows_per_expert=600.0, promotion="k128", n_rows=4096, arrival=None, max_tile=None, wgs=None
    )
    with pytest.raises(MegaMoEInputError, match=match):
        heuristics.prefill_path(1, True, **{**args, **change})


@pytest.mark.parametrize("promotion", ["k32", "k128"])
def test_the_fused_layers_gemm_parameters_name_every_contract_field(monkeypatch, promotion):
    # The fused layer packs its own GemmParams (megamoe.launchers.FusedLauncher); a field added to
    # the contract for the standalone GEMMs must be given there too, or every fused call fails on the
    # GPU (w_e4m3 once did, and only the GPU tests saw it). The GPU-only parts are stubbed: the
    # tensor maps and the error record.
    from megamoe import moe as M
    from megamoe import reference as ref
    from megamoe.jit import contract as C
    from megamoe.jit import driver
    from megamoe.launchers import FusedLauncher

    cfg = ref.MoEConfig(hidden=512, intermediate=512, num_experts=2, top_k=1, num_ranks=1, max_tokens_per_rank=8)
    *_, kw = _small_call_args()
    monkeypatch.setattr(driver, "tma_2d_u8", lambda *a: bytes(128))
    monkeypatch.setattr(runtime, "err_record", lambda dev: torch.zeros(8, dtype=torch.int32))
    layout, total = C.workspace_layout(cfg)
    ws = M._Workspace(torch.zeros(total, dtype=torch.uint8), layout)
    layer = dict(cfg=cfg, dims=C.workspace_dims(cfg), ws=ws, kw=kw, dev=0, clamp=0.0, has_clamp=0, bias=None, dump=None)
    for engine in jb.FUSED_ENGINES_OF[promotion]:
        launcher = FusedLauncher(jb.FusedSpec(promotion=promotion, engine=engine))
        for n in (1, 2):
            for w_e4m3 in (0, 1 << 20):  # the swap-AB engine, the prefill engine (its scratch)
                assert len(launcher.gemm_params(n, **layer, w_e4m3=w_e4m3)) == C.GEMM_PARAMS.size


def test_a_gpt_oss_layers_gemm_parameters_carry_its_biases_alpha_limit_and_l2s_routing_weights(monkeypatch):
    # SPEC §8 in FusedParams' two GemmParams: L1 b1 and fp32(alpha), the clamp at bf16(limit); L2 b2
    # and the pool's routing weights (D8's b2 term); a plain layer's none of them.
    import struct

    from megamoe import moe as M
    from megamoe.jit import contract as C
    from megamoe.jit import driver
    from megamoe.launchers import FusedLauncher

    plain = ref.MoEConfig(hidden=512, intermediate=512, num_experts=2, top_k=1, num_ranks=1, max_tokens_per_rank=8)
    oai = dataclasses.replace(plain, activation="swiglu_oai")
    *_, kw = _small_call_args()
    monkeypatch.setattr(driver, "tma_2d_u8", lambda *a: bytes(128))
    monkeypatch.setattr(runtime, "err_record", lambda dev: torch.zeros(8, dtype=torch.int32))
    b1, b2 = torch.zeros(2, 1024, dtype=torch.bfloat16), torch.zeros(2, 512, dtype=torch.bfloat16)
    for cfg in (plain, oai):
        layout, total = C.workspace_layout(cfg)
        ws = M._Workspace(torch.zeros(total, dtype=torch.uint8), layout)
        launcher = FusedLauncher(jb.FusedSpec(promotion="k32", activation=cfg.activation))
        clamp, has_clamp = LA.clamp(7.0) if cfg is oai else (0.0, 0)
        common = dict(cfg=cfg, dims=C.workspace_dims(cfg), ws=ws, kw=kw, dev=0, dump=None, w_e4m3=0)
        fields = {}
        for n, bias in ((1, b1), (2, b2)):
            raw = launcher.gemm_params(n, **common, clamp=clamp, has_clamp=has_clamp, bias=bias)
            fields[n] = {
                name: struct.unpack_from("<f" if name in ("alpha", "clamp_value") else "<Q", raw, C.OFFSETS[name])[0]
                for name in ("bias", "alpha", "w_route", "clamp_value")
            }
        if cfg is oai:
            assert (fields[1]["bias"], fields[2]["bias"]) == (b1.data_ptr(), b2.data_ptr())
            assert fields[1]["alpha"] == struct.unpack("<f", struct.pack("<f", 1.702))[0] and fields[2]["alpha"] == 0
            assert fields[1]["clamp_value"] == 7.0
            assert fields[1]["w_route"] == fields[2]["w_route"] == ws.ptr("pool_weights")
        else:
            assert fields[1]["bias"] == fields[2]["bias"] == 0 and fields[1]["alpha"] == 0.0
            assert fields[2]["w_route"] == 0


def test_the_launch_key_and_the_device_check_cover_every_tensor_of_the_kernel_weights():
    """A KernelWeights tensor the launch holds but the key leaves out would let a cached launch keep a
    stale address; one the device check leaves out could fault the kernel."""
    kw = _small_call_args()[5]
    tensors = {f.name for f in dataclasses.fields(kw) if isinstance(getattr(kw, f.name), torch.Tensor)}
    assert tensors == set(LA.KW_TENSORS)
    assert sum(len(LA.kw_key(kw, layer)) for layer in (1, 2)) == len(tensors)


def test_the_fast_mode_refuses_weights_with_a_row_far_under_its_experts_largest():
    """SPEC §2: the fast mode keeps accumulators relative to the expert's largest row scale, so a
    row more than FAST_ROW_SPREAD binades under it is refused (promotion k32 takes it)."""
    w = ref.random_weights(2, 512, 512, seed=0)
    row = w.w2_sf[1, 7].clone()
    w.w2_sf[1, 7] = 254  # one L2 row of expert 1 at 2^127
    kw = G.transform_weights(w.w1, w.w1_sf, w.w2, w.w2_sf)
    assert kw.row_spread > ref.quantize.FAST_ROW_SPREAD
    # the kernel layout's row bases and the canonical scale bytes say the same
    assert kw.row_spread == max(ref.quantize.weight_row_spread(sf) for sf in (w.w1_sf, w.w2_sf))
    LA.check_fast_spread("kw", kw.row_spread, "k32")
    with pytest.raises(ref.MegaMoEInputError, match="argument 'kw': expected for promotion 'k128'"):
        LA.check_fast_spread("kw", kw.row_spread, "k128")
    w.w2_sf[1, 7] = row
    LA.check_fast_spread("kw", G.transform_weights(w.w1, w.w1_sf, w.w2, w.w2_sf).row_spread, "k128")


def test_gemm_params_packs_the_activation_maps_the_shape_and_the_trap_record_with_every_other_field(monkeypatch):
    """megamoe.launch.gemm_params, GemmParams' one builder: the two tensor maps over the activations
    (8- and CHUNK_N-row boxes; none for x = 0), the shape (k32_steps from `channels` where K is
    padded) and `err` at their contract offsets."""
    from megamoe import launch as LA
    from megamoe.jit import contract

    calls = []

    def fake_map(ptr, k, rows, stride, box_k, box_rows):
        calls.append((ptr, k, rows, stride, box_k, box_rows))
        return bytes([box_rows % 256]) * 128

    monkeypatch.setattr(LA.driver, "tma_2d_u8", fake_map)
    rest = {f.name: 0 for f in contract.PARAMS if f.name not in LA.SHAPE_FIELDS}
    b = LA.gemm_params(4096, 512, 192, 1024, 3, 77, **rest)
    off = contract.GEMM_PARAMS.offsets
    assert calls == [
        (4096, 512, 192, 512, contract.BLOCK_K, 8),
        (4096, 512, 192, 512, contract.BLOCK_K, contract.CHUNK_N),
    ]
    assert b[off["tmap_x8"] : off["tmap_x8"] + 128] == bytes([8]) * 128
    assert b[off["tmap_x64"] : off["tmap_x64"] + 128] == bytes([contract.CHUNK_N]) * 128

    def words(b):
        names = ("num_experts", "num_pool_rows", "k", "k32_steps", "n_rows")
        return {n: int.from_bytes(b[off[n] : off[n] + 4], "little") for n in names}

    assert words(b) == dict(num_experts=3, num_pool_rows=192, k=512, k32_steps=16, n_rows=1024)
    # A size padded to whole K blocks: its k32 steps are the channels', not k's.
    padded = LA.gemm_params(4096, 512, 192, 1024, 3, 77, channels=480, **rest)
    assert words(padded) == dict(num_experts=3, num_pool_rows=192, k=512, k32_steps=15, n_rows=1024)
    assert int.from_bytes(b[off["err"] : off["err"] + 8], "little") == 77
    calls.clear()
    none = LA.gemm_params(0, 512, 0, 1024, 3, 77, **rest)
    assert not calls and none[off["tmap_x8"] : off["tmap_x8"] + 256] == bytes(256)
    with pytest.raises(Exception, match="w_sf"):
        LA.gemm_params(4096, 512, 192, 1024, 3, 77, **{k: v for k, v in rest.items() if k != "w_sf"})
