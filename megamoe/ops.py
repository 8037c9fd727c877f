"""The fused layer as a PyTorch custom op, `torch.ops.megamoe.moe_layer`, for torch.compile
(fullgraph) and CUDA graphs.

    from megamoe import ops
    y = ops.moe_layer(layer, x, x_sf, topk_idx, topk_weights)            # eager or compiled
    y = torch.ops.megamoe.moe_layer(x, x_sf, topk_idx, topk_weights, ops.register(layer))

Schema: megamoe::moe_layer(Tensor x, Tensor x_sf, Tensor topk_idx, Tensor topk_weights,
int layer_id, bool check_inputs=True) -> Tensor. The op is `layer(x, x_sf, topk_idx,
topk_weights, check_inputs=...)` of a `megamoe.moe.MegaMoE` with the layer's own defaults (the
config's activation clamp and SiLU mode, record_stats=True); y is bf16 [T, cfg.hidden] on x's
device. Forward only: no autograd formula is registered.

Layers by id. A layer is no op argument, so `register(layer)` gives it an int id, the argument the
op takes. The registry holds layers by weak reference: dropping a layer frees its workspace as
before, and a later call with its id raises `LayerNotRegisteredError` saying the layer is gone
(ids are never reused, so an old id never reaches a newer layer). `register` is idempotent; the id
is cached on the layer as `layer._op_id`. A captured CUDA graph replays without Python and so
without the registry: keep the layer alive as long as a graph that launched it may be replayed
(also a graph that torch.compile's mode="reduce-overhead" recorded).

Value checks (SPEC §7). The checks that read input values (an expert id out of range, a duplicate
expert, a NaN scale byte) synchronise the host with the GPU; the shape, dtype, device, contiguity
and alignment checks do not, and MegaMoE applies them to every call. Where the value checks run:
- eager calls (the op or `moe_layer` outside torch.compile): yes, before the launch, as SPEC §7
  asks;
- under CUDA graph capture: no; MegaMoE skips them itself while the stream is capturing (reading a
  value would break the capture), so a captured op behaves as a captured layer call;
- in a torch.compile'd graph: no, when the call goes through `moe_layer`. The op's own body cannot
  tell that it runs inside a compiled graph: Dynamo treats the op as opaque, and at run time its
  body executes as plain Python where `torch.compiler.is_compiling()` is False. The decision is
  therefore taken at trace time, in `moe_layer` (which Dynamo traces and where is_compiling() is
  True), and travels in the graph as the constant `check_inputs=False`. A device synchronisation
  per call would defeat what compiling is for, and graphs compiled with mode="reduce-overhead" are
  captured anyway. The cost: a compiled graph does not refuse bad routing values; check them
  eagerly (megamoe.reference.validate.check_rank_inputs) where they come from outside. Code that
  wants the checks inside a compiled graph passes check_inputs=True to torch.ops.megamoe.moe_layer
  itself (the schema's default) and pays the synchronisation.

Compiling. `moe_layer` registers a layer on its first eager call. Under torch.compile it only reads
`layer._op_id` (registering means a lock and a weak reference, which Dynamo cannot trace), so a
layer must be registered, by `register(layer)` or one eager call, before a graph that uses it is
traced; otherwise tracing stops with `LayerNotRegisteredError` (under fullgraph=True, Dynamo
reports it as an "Observed exception" naming that class). Dynamo guards on the id, so a compiled
function given another layer recompiles.

Purity. The op is declared a pure function of its inputs (mutates_args=()), although the kernel
writes the layer's workspace: the workspace is internal state that the kernel's cleanup returns to
its clean state at the end of every call (SPEC §3, D10: no state that changes the next call's
result), so y depends on the op's arguments only, which is all the compiler needs to know. The
one lasting effect is the cumulative `recv_stats` (D10). Inside a compiled graph, a call whose y is
unused may be removed and two calls with the same arguments may be merged; their tokens are then
not counted in recv_stats. Read recv_stats outside compiled regions. The layer has one workspace:
two calls of one layer must not run concurrently on different streams (a compiled graph issues its
calls in order on one stream).
"""

from __future__ import annotations

import threading
import weakref

import torch

__all__ = ["LayerNotRegisteredError", "SCHEMA", "layer_of", "moe_layer", "register"]

SCHEMA = "(Tensor x, Tensor x_sf, Tensor topk_idx, Tensor topk_weights, int layer_id, bool check_inputs=True) -> Tensor"


class LayerNotRegisteredError(LookupError):
    """An op call named a layer id that `register` never issued, or whose layer is gone."""


_LAYERS: dict[int, weakref.ref] = {}
_issued = 0  # ids 1.._issued have been given out
_LOCK = threading.Lock()


def register(layer) -> int:
    """The op's id of `layer` (a MegaMoE, or any object with `.cfg.hidden` that is called like
    one), issued on the first call and cached as `layer._op_id`. The registry keeps only a weak
    reference to the layer."""
    global _issued
    cfg = getattr(layer, "cfg", None)
    if not isinstance(getattr(cfg, "hidden", None), int) or not callable(layer):
        raise TypeError(
            f"megamoe.ops.register: expected a MegaMoE layer (callable, with cfg.hidden), got {type(layer).__name__}"
        )
    with _LOCK:
        layer_id = getattr(layer, "_op_id", None)
        ref = _LAYERS.get(layer_id) if isinstance(layer_id, int) else None
        if ref is not None and ref() is layer:
            return layer_id
        _issued += 1
        layer_id = _issued
        # The callback takes no lock: it can run from the garbage collector in any thread, even
        # one that holds _LOCK. A dict pop is atomic.
        _LAYERS[layer_id] = weakref.ref(layer, lambda _ref, i=layer_id: _LAYERS.pop(i, None))
        layer._op_id = layer_id
        return layer_id


def layer_of(layer_id: int):
    """The live layer registered as `layer_id`; LayerNotRegisteredError when there is none."""
    ref = _LAYERS.get(layer_id)
    layer = ref() if ref is not None else None
    if layer is not None:
        return layer
    if isinstance(layer_id, int) and 0 < layer_id <= _issued:
        raise LayerNotRegisteredError(
            f"megamoe::moe_layer: layer id {layer_id} belonged to a layer that has been garbage-collected "
            "(its workspace is freed). A compiled function that still names it must be traced again with a "
            "live layer, whose id megamoe.ops.register(layer) gives"
        )
    raise LayerNotRegisteredError(
        f"megamoe::moe_layer: layer id {layer_id} was never issued by megamoe.ops.register "
        "(register the MegaMoE layer and pass the id it returns)"
    )


@torch.library.custom_op("megamoe::moe_layer", mutates_args=(), schema=SCHEMA)
def _moe_layer(
    x: torch.Tensor,
    x_sf: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    layer_id: int,
    check_inputs: bool = True,
) -> torch.Tensor:
    # mutates_args=(): the kernel writes the layer's workspace, which is no argument and is back in
    # its clean state when the call ends (D10); y is a function of the arguments alone. See the
    # module docstring for what the compiler may then do (recv_stats).
    return layer_of(layer_id)(x, x_sf, topk_idx, topk_weights, check_inputs=check_inputs)


@_moe_layer.register_fake
def _moe_layer_fake(x, x_sf, topk_idx, topk_weights, layer_id, check_inputs=True):
    # The output's metadata only. The checks stay with the real call (shape checks at run time
    # cost nothing, and a check here on a symbolic T would add guards).
    return x.new_empty((x.shape[0], layer_of(layer_id).cfg.hidden), dtype=torch.bfloat16)


def moe_layer(layer, x: torch.Tensor, x_sf: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
    """y = torch.ops.megamoe.moe_layer on `layer`: registered on first eager use; value checks
    in eager calls, none in a compiled graph (the module docstring says why)."""
    if torch.compiler.is_compiling():
        layer_id = getattr(layer, "_op_id", None)
        if layer_id is None:
            raise LayerNotRegisteredError(
                "megamoe.ops.moe_layer: the layer is not registered; call megamoe.ops.register(layer) "
                "(or make one eager call) before torch.compile traces it"
            )
        return torch.ops.megamoe.moe_layer.default(x, x_sf, topk_idx, topk_weights, layer_id, False)
    return torch.ops.megamoe.moe_layer.default(x, x_sf, topk_idx, topk_weights, register(layer), True)
