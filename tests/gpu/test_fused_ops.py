"""The fused layer through its custom op, torch.ops.megamoe.moe_layer (megamoe/ops.py), on one rank:
an eager op call gives the layer call's bits and writes none of its inputs; bad routing is still
refused before a launch; a torch.compile'd function (fullgraph, inductor; and mode="reduce-overhead",
which replays CUDA graphs) gives the eager bits; the op captured in a CUDA graph and replayed gives
the eager bits, also after new inputs are copied into the captured tensors; the registry lets a
dropped layer go; a call keeps none of its input tensors alive; torch.library.opcheck on the real layer.

Run: pytest -s tests/gpu/test_fused_ops.py"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from megamoe import ops
from megamoe import reference as ref
from megamoe.moe import MegaMoE

CFG = dict(hidden=1024, intermediate=512, num_experts=16, top_k=4, num_ranks=1, max_tokens_per_rank=128, block_m=64)


def _cfg() -> ref.MoEConfig:
    return ref.MoEConfig(**CFG)


def _weights(cfg: ref.MoEConfig, seed: int = 3) -> ref.ExpertWeights:
    return ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=seed, device="cuda")


@pytest.fixture(scope="module")
def layer() -> MegaMoE:
    cfg = _cfg()
    return MegaMoE(cfg, _weights(cfg))


def _inputs(tokens, distribution="uniform", masked_ratio=0.0, seed=11) -> ref.RankInputs:
    return ref.make_inputs(
        _cfg(), tokens, seed=seed, distribution=distribution, masked_ratio=masked_ratio, device="cuda"
    )[0]


def _args(inp: ref.RankInputs) -> tuple[torch.Tensor, ...]:
    return inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


ROUTINGS = [("uniform", 128, 0.0), ("skewed", 100, 0.1), ("one_hot", 64, 0.0), ("uniform", 1, 0.0), ("uniform", 0, 0.0)]


@pytest.mark.parametrize("distribution,tokens,masked", ROUTINGS, ids=[f"{r[0]}-T{r[1]}-m{r[2]}" for r in ROUTINGS])
def test_an_eager_op_call_equals_the_layer_call_bit_for_bit_and_writes_none_of_its_inputs(
    layer, distribution, tokens, masked
):
    inp = _inputs(tokens, distribution, masked)
    args = _args(inp)
    want = layer(*args)
    before = [a.clone() for a in args]
    layer_id = ops.register(layer)
    got = [
        ops.moe_layer(layer, *args),
        torch.ops.megamoe.moe_layer(*args, layer_id),
        torch.ops.megamoe.moe_layer(*args, layer_id, False),
    ]
    torch.cuda.synchronize()
    for y in got:
        assert y.device == want.device
        assert _same_bits(y, want)
    for a, b in zip(args, before):  # what opcheck's test_schema checks (it cannot compare float8)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_an_eager_op_call_refuses_bad_routing_before_any_launch(layer):
    inp = _inputs(16)
    torch.cuda.synchronize()
    before = layer.ws.buffer.clone()
    bad = inp.topk_idx.clone()
    bad[3, 1] = bad[3, 0]  # a duplicate expert: a value check
    with pytest.raises(ref.MegaMoEInputError, match="topk_idx"):
        ops.moe_layer(layer, inp.x, inp.x_sf, bad, inp.topk_weights)
    with pytest.raises(ref.MegaMoEInputError, match="x_sf"):
        torch.ops.megamoe.moe_layer(inp.x, inp.x_sf.clone().fill_(255), inp.topk_idx, inp.topk_weights, layer._op_id)
    torch.cuda.synchronize()
    assert torch.equal(layer.ws.buffer, before)


def test_a_compiled_function_that_calls_the_op_and_adds_a_residual_equals_eager_bit_for_bit(layer):
    torch._dynamo.reset()
    ops.register(layer)  # before tracing: the trace reads the layer's id, it does not register

    def fn(x, x_sf, topk_idx, topk_weights, residual):
        return ops.moe_layer(layer, x, x_sf, topk_idx, topk_weights) + residual

    compiled = torch.compile(fn, fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for tokens, distribution, seed in ((128, "uniform", 1), (77, "skewed", 2), (1, "one_hot", 3), (128, "skewed", 4)):
        args = _args(_inputs(tokens, distribution, 0.1, seed=seed))
        residual = torch.randn(tokens, CFG["hidden"], device="cuda", generator=g).to(torch.bfloat16)
        want = fn(*args, residual)
        got = compiled(*args, residual)
        torch.cuda.synchronize()
        assert _same_bits(got, want), (tokens, distribution)


def test_a_function_compiled_with_cuda_graphs_equals_eager_bit_for_bit(layer):
    # mode="reduce-overhead": inductor's CUDA graph trees warm up, record and then replay the op.
    torch._dynamo.reset()
    ops.register(layer)

    def fn(x, x_sf, topk_idx, topk_weights, residual):
        return ops.moe_layer(layer, x, x_sf, topk_idx, topk_weights).float() + residual

    compiled = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
    residual = torch.randn(96, CFG["hidden"], device="cuda")
    for seed in range(5):  # the first calls warm up and record, the later ones replay
        args = _args(_inputs(96, "skewed", 0.1, seed=seed))
        want = fn(*args, residual)
        torch.compiler.cudagraph_mark_step_begin()
        got = compiled(*args, residual).clone()
        torch.cuda.synchronize()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), seed


def test_the_op_captured_in_a_cuda_graph_replays_to_the_eager_bits(layer):
    first, second = _inputs(128, "uniform", seed=5), _inputs(128, "skewed", 0.2, seed=6)
    static = [a.clone() for a in _args(first)]
    want_first = ops.moe_layer(layer, *_args(first))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops.moe_layer(layer, *static)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # eager op: the layer skips its value checks while capturing
        y = ops.moe_layer(layer, *static)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert _same_bits(y, want_first)
    for dst, src in zip(static, _args(second)):  # new routing, same tensors: the graph follows
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    got_second = y.clone()
    want_second = ops.moe_layer(layer, *_args(second))
    torch.cuda.synchronize()
    assert _same_bits(got_second, want_second)
    assert not _same_bits(want_second, want_first)


def test_a_call_keeps_none_of_its_input_tensors_alive(layer):
    # CUDA graph trees (mode="reduce-overhead") free the recording's input tensors inside the
    # graph and checkpoint their pool's allocator state: a tensor the layer kept would be memory
    # handed out twice. The repeated-call fast path holds weak references only.
    inp = _inputs(64, seed=21)
    args = [a.clone() for a in _args(inp)]
    layer(*args)
    layer(*args)  # the second call takes the same-tensors path
    torch.cuda.synchronize()
    refs = [weakref.ref(a) for a in args]
    del args, inp
    gc.collect()
    assert [r() for r in refs] == [None] * 4


def test_a_dropped_layer_is_freed_and_its_id_raises():
    cfg = _cfg()
    inp = _inputs(32)
    dropped = MegaMoE(cfg, _weights(cfg, seed=4))
    ops.moe_layer(dropped, *_args(inp))
    torch.cuda.synchronize()
    layer_id, alive = dropped._op_id, weakref.ref(dropped)
    del dropped
    gc.collect()
    assert alive() is None  # the registry held it weakly: the workspace went with it
    with pytest.raises(ops.LayerNotRegisteredError, match="garbage-collected"):
        torch.ops.megamoe.moe_layer(*_args(inp), layer_id)


def test_opcheck_finds_the_fake_implementation_and_registration_consistent_with_the_real_layer(layer):
    # test_schema is left out: it compares inputs with torch.allclose, which has no float8 kernel;
    # the first test compares the inputs byte by byte instead.
    args = (*_args(_inputs(70, "skewed", 0.1)), ops.register(layer))
    torch.library.opcheck(
        torch.ops.megamoe.moe_layer.default,
        args,
        test_utils=("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration"),
    )
