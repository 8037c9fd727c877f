"""Bad input at the fused layer (SPEC §7), every case through `MegaMoE.__call__`, the torch op and
one rank of two: each refused with a one-line MegaMoEInputError naming the argument, before
anything is launched, on every rank, and nothing written (the workspace, `out`, `recv_stats`)."""

from __future__ import annotations

import pytest
import torch

from megamoe import multirank, ops
from megamoe import reference as ref
from megamoe.moe import MegaMoE

SHAPE = dict(hidden=512, intermediate=256, num_experts=8, top_k=2, max_tokens_per_rank=32)
TOKENS = 32


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values at an address 1 byte past a 16-byte boundary (TMA needs 16)."""
    raw = torch.empty(t.numel() * t.element_size() + 16, dtype=torch.uint8, device=t.device)
    out = raw[1 : 1 + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def _strided(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t], dim=1)[:, : t.shape[1]]  # the right shape, not contiguous


def _set(t: torch.Tensor, where, value) -> torch.Tensor:
    t = t.clone()
    t[where] = value
    return t


# name: (the argument the error must name, a function of (x, x_sf, topk_idx, topk_weights) giving
# the bad call's four tensors, or a function giving its call options)
CASES = {
    "x of dtype bf16": ("x", lambda x, s, i, w: (x.to(torch.bfloat16), s, i, w), None),
    "x on the CPU": ("x", lambda x, s, i, w: (x.cpu(), s, i, w), None),
    "x not contiguous": ("x", lambda x, s, i, w: (_strided(x.view(torch.uint8)).view(x.dtype), s, i, w), None),
    "x not 16-byte aligned": ("x", lambda x, s, i, w: (_misaligned(x), s, i, w), None),
    "x of the wrong width": ("x", lambda x, s, i, w: (x[:, :-32].contiguous(), s, i, w), None),
    "x_sf of dtype int64": ("x_sf", lambda x, s, i, w: (x, s.to(torch.int64), i, w), None),
    "x_sf of the wrong shape": ("x_sf", lambda x, s, i, w: (x, s[:, :-1].contiguous(), i, w), None),
    "x_sf with a NaN scale byte": ("x_sf", lambda x, s, i, w: (x, _set(s, (3, 2), 255), i, w), None),
    "topk_idx of dtype int32": ("topk_idx", lambda x, s, i, w: (x, s, i.to(torch.int32), w), None),
    "topk_idx with an expert id E": ("topk_idx", lambda x, s, i, w: (x, s, _set(i, (5, 0), 8), w), None),
    "topk_idx with an expert id -2": ("topk_idx", lambda x, s, i, w: (x, s, _set(i, (5, 1), -2), w), None),
    "topk_idx with an expert twice": ("topk_idx", lambda x, s, i, w: (x, s, _set(i, (7, 1), int(i[7, 0])), w), None),
    "topk_idx with other tokens": ("topk_idx", lambda x, s, i, w: (x, s, i[:-1].contiguous(), w), None),
    "topk_weights of dtype fp16": ("topk_weights", lambda x, s, i, w: (x, s, i, w.half()), None),
    "topk_weights of the wrong shape": ("topk_weights", lambda x, s, i, w: (x, s, i, w[:, :1].contiguous()), None),
    "out of dtype fp32": ("out", None, lambda: dict(out=torch.empty(TOKENS, 512, device="cuda"))),
    "out of the wrong shape": (
        "out",
        None,
        lambda: dict(out=torch.empty(TOKENS, 256, dtype=torch.bfloat16, device="cuda")),
    ),
    "a negative activation_clamp": ("activation_clamp", None, lambda: dict(activation_clamp=-1.0)),
    "an activation_clamp string": ("activation_clamp", None, lambda: dict(activation_clamp="1.5")),
}
TENSOR_CASES = [name for name, (_, bad, _) in CASES.items() if bad is not None]


def _cfg(ranks: int = 1) -> ref.MoEConfig:
    return ref.MoEConfig(**SHAPE, num_ranks=ranks)


def _layer_and_inputs(ranks: int = 1, rank: int = 0, group=None):
    cfg = _cfg(ranks)
    w = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=2, device="cuda")
    layer = MegaMoE(cfg, w, group=group)
    inp = ref.make_inputs(cfg, TOKENS, seed=2, device="cuda")[rank]
    return layer, (inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)


def _bad_call(name: str, args: tuple):
    """The bad call's tensors and options."""
    _, bad, opts = CASES[name]
    return (bad(*args) if bad else args), (opts() if opts else {})


def _refusal(call) -> str | None:
    try:
        call()
    except ref.MegaMoEInputError as e:
        return str(e)
    return None


def _state(layer: MegaMoE) -> torch.Tensor:
    torch.cuda.synchronize()
    return layer.ws.buffer.clone()


@pytest.fixture(scope="module")
def one_rank():
    return _layer_and_inputs()


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_call_is_refused_in_one_line_naming_its_argument_and_writes_nothing(one_rank, name):
    layer, args = one_rank
    (x, s, i, w), opts = _bad_call(name, args)
    out = opts.pop("out", None)
    if out is None:  # a valid out, whose bytes must stay as they are
        out = torch.full((TOKENS, SHAPE["hidden"]), 7.0, dtype=torch.bfloat16, device="cuda")
    before, out_before = _state(layer), out.clone()
    message = _refusal(lambda: layer(x, s, i, w, out=out, **opts))
    arg = CASES[name][0]
    assert message is not None and f"argument '{arg}'" in message and "\n" not in message, message
    assert torch.equal(_state(layer), before) and torch.equal(out.view(torch.uint8), out_before.view(torch.uint8))


@pytest.mark.parametrize("name", TENSOR_CASES)
def test_a_bad_op_call_is_refused_in_one_line_naming_its_argument_and_writes_nothing(one_rank, name):
    layer, args = one_rank
    (x, s, i, w), _ = _bad_call(name, args)
    before = _state(layer)
    message = _refusal(lambda: ops.moe_layer(layer, x, s, i, w))
    arg = CASES[name][0]
    assert message is not None and f"argument '{arg}'" in message and "\n" not in message, message
    assert torch.equal(_state(layer), before)


def _every_case_on_two_ranks(rank: int, ranks: int) -> dict:
    """In a spawned rank: every case, bad on rank 1 only (rank 0 makes the good call); what each
    rank saw."""
    layer, args = _layer_and_inputs(ranks, rank, multirank.group())
    out = {}
    for name in CASES:
        (x, s, i, w), opts = _bad_call(name, args) if rank == 1 else (args, {})
        before, stats = _state(layer), layer.recv_stats.clone()
        message = _refusal(lambda: layer(x, s, i, w, **opts))
        out[name] = (message, torch.equal(_state(layer), before), torch.equal(layer.recv_stats, stats))
    return out


def test_one_ranks_bad_call_is_refused_on_every_rank_and_writes_nothing_on_either():
    per_rank = multirank.spawn(_every_case_on_two_ranks, 2, timeout=600)
    for name, (arg, _, _) in CASES.items():
        for rank, seen in enumerate(per_rank):
            message, untouched, stats = seen[name]
            assert message is not None and "\n" not in message, (name, rank, message)
            assert f"argument '{arg}'" in message, (name, rank, message)  # rank 0 quotes rank 1's
            if rank == 0:
                assert message.startswith("rank 1 refused its call"), (name, message)
            assert untouched and stats, (name, rank)
