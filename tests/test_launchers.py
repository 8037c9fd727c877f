"""What the entry points launch, on the CPU: with the device stubbed (the loaded kernel, the trap
record, the item counters, the scratch buffers, the tensor maps, the stream) and the driver's launch
function recording its arguments, each launch of l1_gemm, l2_gemm and the fused layer has the
kernel, grid, block, dynamic shared memory and parameter bytes that its spec gives. The expected
values are computed here from the spec and the call's tensors the way the launch code computed them
before it moved into megamoe.launchers (one launcher per kernel kind)."""

import ctypes
import struct
import types

import pytest
import torch

from megamoe import gemm as G
from megamoe import heuristics
from megamoe import launch as LA
from megamoe import launchers as LN
from megamoe import reference as ref
from megamoe import runtime
from megamoe.jit import build as jb
from megamoe.jit import contract as C
from megamoe.jit import driver
from megamoe.jit import layout as L

STREAM = 0x5EED0
SMS = 132  # the fake device's SMs
SMEM = 200_000  # every fake kernel's dynamic shared memory (what the cubin would say)
E, H, INTER, P = 2, 512, 512, 128  # H and I multiples of 512: the fast mode's L1 and L2


@pytest.fixture
def device(monkeypatch):
    """A device on the CPU: what the launches ask of megamoe.runtime and the driver is stubbed, and
    each call of the driver's launch function is recorded with its parameter bytes (read at the
    launch: later patches of a kept launch do not change what was launched)."""
    rec = types.SimpleNamespace(launches=[], fns={}, counters=[], scratch={}, err=torch.zeros(8, dtype=torch.int32))

    def kernel(spec, dev):
        fn = rec.fns.setdefault(spec, 0x1000 * (1 + len(rec.fns)))
        return runtime.Kernel(spec, None, fn, SMEM, spec.threads, 4, SMS)

    def item_counter(dev):
        rec.counters.append(0xC0000 + 8 * len(rec.counters))
        return rec.counters[-1]

    def prefill_scratch(dev, stream, layer, size):
        return rec.scratch.setdefault((stream, layer, size), torch.empty(size, dtype=torch.uint8))

    def tma_2d_u8(ptr, inner, outer, row_stride, box_inner, box_outer):
        return struct.pack("<6Q", ptr, inner, outer, row_stride, box_inner, box_outer).ljust(128, b"\0")

    def raw(name):
        cooperative = name == "cuLaunchCooperativeKernel"
        size = (C.FUSED_PARAMS if cooperative else C.GEMM_PARAMS).size

        def launch(fn, gx, gy, gz, bx, by, bz, smem, stream, args, *extra):
            rec.launches.append(
                dict(
                    fn=fn.value,
                    grid=(gx, gy, gz),
                    block=(bx, by, bz),
                    smem=smem,
                    stream=stream.value,
                    cooperative=cooperative,
                    extra=extra,  # cuLaunchKernel's `extra` (None); the cooperative launch has none
                    params=ctypes.string_at(args[0], size),
                )
            )
            return 0

        return launch

    monkeypatch.setattr(driver, "_raw", raw)
    monkeypatch.setattr(driver, "tma_2d_u8", tma_2d_u8)
    monkeypatch.setattr(runtime, "kernel", kernel)
    monkeypatch.setattr(runtime, "err_record", lambda dev: rec.err)
    monkeypatch.setattr(runtime, "item_counter", item_counter)
    monkeypatch.setattr(runtime, "prefill_scratch", prefill_scratch)
    monkeypatch.setattr(runtime, "device_index", lambda dev: 0)
    monkeypatch.setattr(runtime, "stream", lambda t: STREAM)
    monkeypatch.setattr(runtime, "stream_of", lambda dev: STREAM)
    monkeypatch.setattr(runtime, "raw_stream", lambda dev: STREAM)
    monkeypatch.setattr(runtime, "_CALLS", {})
    monkeypatch.setattr(runtime, "_LAUNCHES", {})
    monkeypatch.setattr(G, "require_cuda", lambda name, t: None)  # CPU tensors stand for the GPU's
    return rec


def _expected(rec, spec, grid: int, params: bytes, *, cooperative: bool = False) -> dict:
    return dict(
        fn=rec.fns[spec],
        grid=(grid, 1, 1),
        block=(spec.threads, 1, 1),
        smem=SMEM,
        stream=STREAM,
        cooperative=cooperative,
        extra=() if cooperative else (None,),
        params=params,
    )


# The fused kernel's hooks that a standalone GEMM launch leaves off.
_STANDALONE = dict(
    bias=0,
    alpha=0.0,
    signal=0,
    rebase_x=0,
    rebase_sf=0,
    rebase_count=0,
    peer_offsets=0,
    arrival_need=0,
    combine_rows=0,
)


def _weights():
    w = ref.random_weights(E, H, INTER, seed=1)
    return L.transform_weights(w.w1, w.w1_sf, w.w2, w.w2_sf)


@pytest.mark.parametrize("promotion", ["k32", "k128"])
@pytest.mark.parametrize("layer", [1, 2])
@pytest.mark.parametrize("prefill", [False, True])
def test_a_standalone_gemm_launches_its_specs_kernel_geometry_and_parameter_bytes(device, promotion, layer, prefill):
    kw = _weights()
    k, n_rows = (H, 2 * INTER) if layer == 1 else (INTER, H)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 0x7F, (P, k), generator=g, dtype=torch.uint8)
    sf = torch.full((P, k // 32), 127, dtype=torch.uint8)
    rebased = {}
    if promotion == "k128":
        x, sf = G.rebase_k128(x, sf)
        rebased = dict(x_sf128=sf)
    offsets = torch.tensor([0, 64, 128], dtype=torch.int32)
    rows = torch.tensor([10, 20], dtype=torch.int32)
    if layer == 1:
        w_route = torch.ones(P)
        out = torch.empty(P, INTER, dtype=torch.float8_e4m3fn)
        out_sf = torch.empty(P, INTER // 32, dtype=torch.uint8)
        args = (x, sf, offsets, rows, w_route, kw)
        opts = dict(out=out, out_sf=out_sf, activation_clamp=7.3)
        call = dict(w_route=w_route.data_ptr(), out=out.data_ptr(), out_sf=out_sf.data_ptr(), dst_rows=0)
        call.update(has_clamp=1, clamp_value=LA.clamp(7.3)[0], n_out=2 * INTER, out_stride=INTER)
        entry, prepare = G.l1_gemm, G.prepare_l1_gemm
    else:
        dst_rows = torch.arange(P, dtype=torch.int32)
        combine = torch.empty(2, 64, H, dtype=torch.bfloat16)
        args = (x, sf, offsets, rows, dst_rows, kw, combine)
        opts = {}
        call = dict(w_route=0, out=combine.data_ptr(), out_sf=0, dst_rows=dst_rows.data_ptr())
        call.update(has_clamp=0, clamp_value=0.0, n_out=H, out_stride=H)
        entry, prepare = G.l2_gemm, G.prepare_l2_gemm
    entry(*args, promotion=promotion, prefill=prefill, **rebased, **opts)
    # A prepared call of the same arguments: the kept launch (no second item counter), the same bytes.
    prepare(*args, promotion=promotion, prefill=prefill, **rebased, **opts)()

    err = device.err.data_ptr()
    weights = LA.weight_fields(kw, layer, promotion)
    fields = dict(
        **weights,
        **_STANDALONE,
        **call,
        x_sf=sf.data_ptr(),
        expert_offsets=offsets.data_ptr(),
        expert_rows=rows.data_ptr(),
        dump=0,
        arrival=0,
        arrival_block=0,
    )
    want = []
    if prefill:
        pre = jb.PredecodeSpec(promotion=promotion)
        tiles = E * (k // C.BLOCK_K) * (n_rows // C.PREFILL_ROWS[promotion])
        scratch = device.scratch[(STREAM, layer, tiles * C.PREFILL_TILE_BYTES[promotion])]
        # The predecode pass: one warp per 16-row group of one K block; every field but the
        # weights, the scratch and the shape 0.
        rest = {f.name: 0 for f in C.PARAMS if f.name not in LA.SHAPE_FIELDS}
        rest.update(weights, w_e4m3=scratch.data_ptr())
        groups = E * (k // C.BLOCK_K) * (n_rows // 16)
        want.append(
            _expected(device, pre, groups // (pre.threads // 32), LA.gemm_params(0, k, 0, n_rows, E, err, **rest))
        )
        spec = jb.PrefillSpec(layer=layer, fast_math=True, debug=False, promotion=promotion)
        fields.update(item_counter=device.counters[0], w_e4m3=scratch.data_ptr())
    else:
        spec = heuristics.spec_for(layer, promotion=promotion, n_rows=n_rows, rows_per_expert=P / E)
        fields.update(item_counter=device.counters[0], w_e4m3=0)
    assert len(device.counters) == 1  # one pair of item counters per kept launch
    want.append(_expected(device, spec, SMS, LA.gemm_params(x.data_ptr(), k, P, n_rows, E, err, **fields)))
    assert set(device.fns) == ({spec, jb.PredecodeSpec(promotion=promotion)} if prefill else {spec})
    assert device.launches == want + want


# Every engine; and the prefill engine of a layer made with predecoded=True, whose construction ran
# the predecode pass into buffers of its own, which the fused launch then reads.
FUSED_CASES = [(p, e, False) for p, e in jb.FUSED_MODES] + [(p, "prefill", True) for p in jb.PROMOTIONS]


@pytest.mark.parametrize("promotion,engine,predecoded", FUSED_CASES)
def test_the_fused_layer_launches_its_specs_kernel_cooperatively_with_the_calls_parameter_bytes(
    device, promotion, engine, predecoded
):
    from megamoe import moe as M

    cfg = ref.MoEConfig(hidden=H, intermediate=INTER, num_experts=4, top_k=2, max_tokens_per_rank=16)
    w = ref.random_weights(4, H, INTER, seed=2)
    layout, total = C.workspace_layout(cfg)
    # A layer as MegaMoE.__init__ leaves it, on the CPU (its constructor needs a GPU).
    layer = object.__new__(M.MegaMoE)
    layer.cfg, layer.group, layer.rank, layer.promotion, layer.engine = cfg, None, 0, promotion, engine
    layer._host, layer.device, layer.weights = None, torch.device("cpu"), w
    layer.kw = L.transform_weights(w.w1, w.w1_sf, w.w2, w.w2_sf)
    layer.dims, layer._sms = C.workspace_dims(cfg), 100
    layer.ws = M._Workspace(torch.zeros(total, dtype=torch.uint8), layout)
    layer._launches, layer._scratch, layer._checked, layer._last, layer._debug_buffers = {}, {}, set(), None, None
    layer._biases = (None, None)
    layer._decoded = None
    if predecoded:  # as the constructor does it
        pre_spec = jb.FusedSpec(fast_math=True, debug=False, promotion=promotion, engine="prefill")
        layer._decoded = LN.FusedLauncher(pre_spec).predecode(cfg, layer.kw, 0, STREAM)
    predecodes = device.launches[:]

    T = 5
    x = torch.zeros(T, H, dtype=torch.float8_e4m3fn)
    x_sf = torch.full((T, H // 32), 127, dtype=torch.uint8)
    topk_idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, -1]], dtype=torch.int64)
    topk_weights = torch.ones(T, 2)
    y = layer(x, x_sf, topk_idx, topk_weights, activation_clamp=3.0, record_stats=False, check_inputs=False)

    spec = jb.FusedSpec(fast_math=cfg.fast_math, debug=False, promotion=promotion, engine=engine)
    ws, d, err = layer.ws, layer.dims, device.err.data_ptr()
    fast = promotion == "k128"
    w_e4m3 = [0, 0]
    want_predecodes = []
    if engine == "prefill":
        pre = jb.PredecodeSpec(promotion=promotion)
        for n, (k, rows) in enumerate(((H, 2 * INTER), (INTER, H))):
            tiles = cfg.local_experts * (k // C.BLOCK_K) * (rows // C.PREFILL_ROWS[promotion])
            size = tiles * C.PREFILL_TILE_BYTES[promotion]
            if not predecoded:  # the stream's scratch, which the kernel's own predecode writes
                w_e4m3[n] = device.scratch[(STREAM, n + 1, size)].data_ptr()
                continue
            buf = layer._decoded[n]
            assert buf.numel() == size and not buf.any()  # zeroed where it is made
            w_e4m3[n] = buf.data_ptr()
            # The standalone pass over the layer's weights: every field but the weights, the buffer
            # and the shape 0; one warp per 16-row group of one K block.
            rest = {f.name: 0 for f in C.PARAMS if f.name not in LA.SHAPE_FIELDS}
            rest.update(LA.weight_fields(layer.kw, n + 1, promotion), w_e4m3=buf.data_ptr())
            grid = cfg.local_experts * (k // C.BLOCK_K) * (rows // 16) // (pre.threads // 32)
            params = LA.gemm_params(0, k, 0, rows, cfg.local_experts, err, **rest)
            want_predecodes.append(_expected(device, pre, grid, params))
        assert not predecoded or not device.scratch  # a predecoded layer's launch takes no scratch buffer
    assert predecodes == want_predecodes
    c = LA.clamp(3.0)[0]
    l1 = LA.gemm_params(
        ws.ptr("pool_x128" if fast else "pool_x"),
        H,
        d["P"],
        2 * INTER,
        cfg.local_experts,
        err,
        **LA.weight_fields(layer.kw, 1, promotion),
        x_sf=ws.ptr("pool_sf128" if fast else "pool_x_sf"),
        expert_offsets=ws.ptr("expert_offsets"),
        expert_rows=ws.ptr("recv_totals"),
        w_route=ws.ptr("pool_weights"),
        out=ws.ptr("l2_acts"),
        out_sf=ws.ptr("l2_sf"),
        dst_rows=0,
        peer_offsets=0,
        dump=0,
        arrival=ws.ptr("arrivals"),
        signal=ws.ptr("l1_done"),
        rebase_x=ws.ptr("l2_x128") if fast else 0,
        rebase_sf=ws.ptr("l2_sf128") if fast else 0,
        rebase_count=ws.ptr("rebase_count") if fast else 0,
        item_counter=ws.ptr("item_counter"),
        arrival_block=cfg.block_m,
        arrival_need=0,
        combine_rows=cfg.top_k * cfg.max_tokens_per_rank,
        has_clamp=1,
        clamp_value=c,
        w_e4m3=w_e4m3[0],
        bias=0,
        alpha=0.0,
        n_out=2 * INTER,
        out_stride=INTER,
    )
    l2 = LA.gemm_params(
        ws.ptr("l2_x128" if fast else "l2_acts"),
        INTER,
        d["P"],
        H,
        cfg.local_experts,
        err,
        **LA.weight_fields(layer.kw, 2, promotion),
        x_sf=ws.ptr("l2_sf128" if fast else "l2_sf"),
        expert_offsets=ws.ptr("expert_offsets"),
        expert_rows=ws.ptr("recv_totals"),
        w_route=0,
        out=ws.ptr("combine"),
        out_sf=0,
        dst_rows=ws.ptr("dst_rows"),
        peer_offsets=ws.ptr("peers"),
        dump=0,
        arrival=ws.ptr("l1_done"),
        signal=0,
        rebase_x=0,
        rebase_sf=0,
        rebase_count=0,
        item_counter=ws.ptr("item_counter"),
        arrival_block=cfg.block_m,
        arrival_need=INTER // 32,
        combine_rows=cfg.top_k * cfg.max_tokens_per_rank,
        has_clamp=0,
        clamp_value=0.0,
        w_e4m3=w_e4m3[1],
        bias=0,
        alpha=0.0,
        n_out=H,
        out_stride=H,
    )
    params = C.FUSED_PARAMS.pack(
        l1=l1,
        l2=l2,
        x=x.data_ptr(),
        x_sf=x_sf.data_ptr(),
        topk_idx=topk_idx.data_ptr(),
        topk_weights=topk_weights.data_ptr(),
        y=y.data_ptr(),
        **{f"ws_{r.name}": ws.ptr(r.name) for r in C.WORKSPACE},
        rank=0,
        num_ranks=1,
        num_tokens=T,
        max_tokens=cfg.max_tokens_per_rank,
        hidden=H,
        intermediate=INTER,
        num_experts=cfg.num_experts,
        local_experts=cfg.local_experts,
        top_k=cfg.top_k,
        block_m=cfg.block_m,
        pool_rows=d["P"],
        record_stats=0,
        hidden_pad=d["H_pad"],
        intermediate_pad=d["I_pad"],
        weights_decoded=int(predecoded),
    )
    # The grid: one CTA per SM of the layer's SM count, at most the device's.
    assert device.launches[len(predecodes) :] == [_expected(device, spec, min(100, SMS), params, cooperative=True)]
    assert set(device.fns) == ({spec, jb.PredecodeSpec(promotion=promotion)} if predecoded else {spec})


def test_every_spec_the_library_builds_has_the_launcher_of_its_kind_and_only_the_fused_one_is_cooperative():
    kinds = {
        jb.GemmSpec: LN.GemmLauncher,
        jb.PrefillSpec: LN.PrefillLauncher,
        jb.PredecodeSpec: LN.PredecodeLauncher,
        jb.FusedSpec: LN.FusedLauncher,
    }
    specs = heuristics.used_specs() + heuristics.fused_specs()
    assert {type(spec) for spec in specs} == set(kinds)
    for spec in specs:
        launcher = LN.launcher(spec)
        assert type(launcher) is kinds[type(spec)] and launcher.spec is spec
        assert launcher.cooperative == isinstance(spec, jb.FusedSpec)


def test_a_predecoded_layers_pass_covers_the_fused_layers_own_weights_k_and_rows_at_spec_8_sizes(device):
    # H 352 and I 192: K padded to whole blocks (384, 256), the rows to whole row tiles (384, 384).
    # The standalone pass must decode what the fused prefill engine reads: the same weight fields, K
    # and rows as its GemmParams.
    from megamoe import moe as M

    cfg = ref.MoEConfig(hidden=352, intermediate=192, num_experts=4, top_k=2, max_tokens_per_rank=16)
    w = ref.random_weights(4, 352, 192, seed=3)
    kw = L.transform_weights(w.w1, w.w1_sf, w.w2, w.w2_sf)
    layout, total = C.workspace_layout(cfg)
    ws = M._Workspace(torch.zeros(total, dtype=torch.uint8), layout)
    launcher = LN.FusedLauncher(jb.FusedSpec(promotion="k32", engine="prefill"))
    buffers = launcher.predecode(cfg, kw, 0, STREAM)
    offsets = C.GEMM_PARAMS.offsets
    fields = ("w", "w_sf", "w_row_base", "w_expert_base", "w_fold", "k", "n_rows", "num_experts")

    def read(params: bytes, name: str) -> int:
        kind = next(f.kind for f in C.PARAMS if f.name == name)
        return struct.unpack_from("<Q" if kind == "ptr" else "<i", params, offsets[name])[0]

    assert len(device.launches) == 2
    for n, (launch, buf) in enumerate(zip(device.launches, buffers)):
        fused = launcher.gemm_params(
            n + 1,
            cfg=cfg,
            dims=C.workspace_dims(cfg),
            ws=ws,
            kw=kw,
            dev=0,
            clamp=0.0,
            has_clamp=0,
            bias=None,
            dump=None,
            w_e4m3=0,
        )
        assert {f: read(launch["params"], f) for f in fields} == {f: read(fused, f) for f in fields}, f"L{n + 1}"
        assert read(launch["params"], "w_e4m3") == buf.data_ptr()
        k, rows = read(fused, "k"), read(fused, "n_rows")
        assert (k, rows) == ((384, 384) if n == 0 else (256, 384))
        # The k32 steps that hold channels: H / 32 and I / 32, not the padded K's (the exact
        # consumers skip the rest of the last K block).
        assert read(fused, "k32_steps") == (352 // 32 if n == 0 else 192 // 32)
        # [E_l, K/128, R/128] tiles; one warp a 16-row group of a K block, each group once
        assert buf.numel() == cfg.local_experts * (k // 128) * (rows // 128) * C.PREFILL_TILE_BYTES["k32"]
        assert launch["grid"][0] * 8 == cfg.local_experts * (k // 128) * (rows // 16)
