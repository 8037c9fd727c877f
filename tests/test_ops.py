"""The custom op torch.ops.megamoe.moe_layer (megamoe/ops.py) without a GPU: its schema, its fake
implementation under FakeTensorMode, the layer registry (ids, weak references, clear errors), the
value-check decision in eager and compiled calls, and torch.library.opcheck. A real MegaMoE needs a
GPU, so a stand-in layer (a `.cfg.hidden` and a pure __call__) takes its place; the real layer is
tested in tests/gpu/test_fused_ops.py."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from megamoe import ops

H, K = 256, 4


class _StandIn:
    """Called like a MegaMoE; y = bf16(x * the sum of the token's valid routing weights), a pure
    function of the inputs. Records the check_inputs of every call."""

    def __init__(self, hidden: int = H):
        self.cfg = SimpleNamespace(hidden=hidden)
        self.checks: list[bool] = []

    def __call__(self, x, x_sf, topk_idx, topk_weights, *, check_inputs=True):
        self.checks.append(bool(check_inputs))
        w = torch.where(topk_idx >= 0, topk_weights, 0.0).sum(dim=1, keepdim=True)
        return (x.float() * w).to(torch.bfloat16)


def _inputs(tokens: int, device="cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(torch.float8_e4m3fn)
    x_sf = torch.full((tokens, H // 32), 127, dtype=torch.uint8)
    topk_idx = torch.randint(-1, 16, (tokens, K), generator=g)
    topk_weights = torch.rand(tokens, K, generator=g)
    return tuple(t.to(device) for t in (x, x_sf, topk_idx, topk_weights))


def _fake_inputs(tokens: int, device: str):
    return (
        torch.empty(tokens, H, dtype=torch.float8_e4m3fn, device=device),
        torch.empty(tokens, H // 32, dtype=torch.uint8, device=device),
        torch.empty(tokens, K, dtype=torch.int64, device=device),
        torch.empty(tokens, K, dtype=torch.float32, device=device),
    )


def test_the_op_is_registered_with_the_intended_schema():
    schema = torch.ops.megamoe.moe_layer.default._schema
    assert str(schema) == (
        "megamoe::moe_layer(Tensor x, Tensor x_sf, Tensor topk_idx, Tensor topk_weights, int layer_id, "
        "bool check_inputs=True) -> Tensor"
    )
    assert str(schema) == "megamoe::moe_layer" + ops.SCHEMA
    assert not schema.is_mutable  # a pure function of its inputs: no argument is written
    assert all(a.alias_info is None for a in schema.arguments)
    assert schema.returns[0].alias_info is None  # y is a new tensor, no view of an input


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("tokens", [0, 5, 128])
def test_the_fake_implementation_gives_bf16_tokens_by_hidden_on_the_inputs_device(device, tokens):
    layer = _StandIn(hidden=512)
    layer_id = ops.register(layer)
    with FakeTensorMode():  # fake CUDA tensors need no GPU
        x = torch.empty(tokens, 512, dtype=torch.float8_e4m3fn, device=device)
        rest = _fake_inputs(tokens, device)[1:]
        y = torch.ops.megamoe.moe_layer(x, *rest, layer_id)
    assert isinstance(y, FakeTensor)
    assert tuple(y.shape) == (tokens, 512)
    assert y.dtype == torch.bfloat16
    assert y.device.type == device
    assert layer.checks == []  # the fake implementation never runs the layer


def test_an_eager_op_call_is_the_layer_call_with_the_value_checks_on():
    layer = _StandIn()
    args = _inputs(9)
    y = ops.moe_layer(layer, *args)
    assert torch.equal(y, layer(*args))
    assert layer.checks == [True, True]
    y_op = torch.ops.megamoe.moe_layer(*args, ops.register(layer))
    assert torch.equal(y_op, y) and layer.checks[-1] is True


def test_register_is_idempotent_caches_the_id_on_the_layer_and_never_reuses_an_id():
    a, b = _StandIn(), _StandIn()
    ia = ops.register(a)
    assert ops.register(a) == ia == a._op_id
    assert ops.layer_of(ia) is a
    ib = ops.register(b)
    assert ib != ia and ops.layer_of(ib) is b
    del b
    gc.collect()
    c = _StandIn()
    assert ops.register(c) not in (ia, ib)


def test_a_copied_layer_gets_its_own_id_not_the_originals():
    import copy

    a = _StandIn()
    ia = ops.register(a)
    b = copy.copy(a)  # carries a._op_id, but is another object
    assert ops.register(b) != ia and ops.layer_of(ia) is a


def test_register_refuses_an_object_that_is_not_a_layer():
    with pytest.raises(TypeError, match="expected a MegaMoE layer"):
        ops.register(object())
    with pytest.raises(TypeError, match="expected a MegaMoE layer"):
        ops.register(SimpleNamespace(cfg=SimpleNamespace(hidden=256)))  # not callable


def test_an_id_that_was_never_issued_raises_a_clear_error_in_real_and_fake_calls():
    args = _inputs(3)
    with pytest.raises(
        ops.LayerNotRegisteredError, match=r"layer id 987654321 was never issued by megamoe.ops.register"
    ):
        torch.ops.megamoe.moe_layer(*args, 987654321)
    with FakeTensorMode():
        fake = _fake_inputs(3, "cuda")
        with pytest.raises(ops.LayerNotRegisteredError, match="was never issued"):
            torch.ops.megamoe.moe_layer(*fake, -1)


def test_the_registry_does_not_keep_a_layer_alive_and_a_dropped_layers_id_raises():
    layer = _StandIn()
    layer_id = ops.register(layer)
    alive = weakref.ref(layer)
    del layer
    gc.collect()
    assert alive() is None  # the registry held it weakly: a dropped MegaMoE frees its workspace
    with pytest.raises(ops.LayerNotRegisteredError, match=rf"layer id {layer_id} belonged to a layer that has been"):
        torch.ops.megamoe.moe_layer(*_inputs(2), layer_id)
    with FakeTensorMode():
        fake = _fake_inputs(2, "cuda")
        with pytest.raises(ops.LayerNotRegisteredError, match="garbage-collected"):
            torch.ops.megamoe.moe_layer(*fake, layer_id)


def test_a_compiled_graph_calls_the_op_without_value_checks_and_equals_eager():
    # aot_eager: Dynamo's full-graph trace and AOTAutograd through the fake implementation, with
    # no C++ compiler needed (inductor on the GPU is tests/gpu/test_fused_ops.py's).
    torch._dynamo.reset()
    layer = _StandIn()
    ops.register(layer)
    bias = torch.randn(H)

    def fn(x, x_sf, topk_idx, topk_weights):
        return ops.moe_layer(layer, x, x_sf, topk_idx, topk_weights).float() + bias

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for tokens, seed in ((7, 1), (12, 2)):  # a symbolic token count through the fake implementation
        args = _inputs(tokens, seed=seed)
        layer.checks.clear()
        want = fn(*args)
        assert layer.checks == [True]
        layer.checks.clear()
        got = compiled(*args)
        assert layer.checks == [False]  # decided at trace time, a constant of the graph
        assert torch.equal(got, want)


def test_tracing_a_layer_that_was_never_registered_stops_with_the_registry_error():
    torch._dynamo.reset()
    layer = _StandIn()

    def fn(x, x_sf, topk_idx, topk_weights):
        return ops.moe_layer(layer, x, x_sf, topk_idx, topk_weights) + 1

    with pytest.raises(Exception) as info:
        torch.compile(fn, fullgraph=True, backend="aot_eager")(*_inputs(4))
    # Dynamo reports an exception raised while tracing as its own error, naming the class.
    assert info.type is ops.LayerNotRegisteredError or "LayerNotRegisteredError" in str(info.value)
    assert not hasattr(layer, "_op_id")  # tracing registered nothing


def test_opcheck_finds_the_fake_implementation_and_registration_consistent_with_the_real_one():
    layer = _StandIn()
    args = (*_inputs(6), ops.register(layer))
    torch.library.opcheck(
        torch.ops.megamoe.moe_layer.default,
        args,
        test_utils=("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration"),
    )


def _float8_allclose_works() -> bool:
    a = torch.zeros(2, dtype=torch.float8_e4m3fn)
    try:
        torch.allclose(a, a, equal_nan=True)
    except (NotImplementedError, RuntimeError):
        return False
    return True


@pytest.mark.skipif(
    not _float8_allclose_works(),
    reason="opcheck's test_schema compares every input before and after the call with torch.allclose, "
    "which has no float8_e4m3fn kernel on CPU in this torch; the GPU test checks the inputs byte by byte",
)
def test_opcheck_finds_that_the_op_writes_none_of_its_inputs():
    layer = _StandIn()
    torch.library.opcheck(
        torch.ops.megamoe.moe_layer.default, (*_inputs(6), ops.register(layer)), test_utils="test_schema"
    )
