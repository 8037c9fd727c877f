"""SPEC §7: every kind of bad input raises MegaMoEInputError naming the argument, the expected and
the actual value, before anything runs."""

import dataclasses

import pytest
import torch

from megamoe import reference as ref
from megamoe.reference import MegaMoEInputError

CFG = ref.MoEConfig(
    hidden=256, intermediate=128, num_experts=8, top_k=2, num_ranks=2, max_tokens_per_rank=16, block_m=16
)


@pytest.fixture
def call():
    return ref.make_inputs(CFG, 16, seed=0), ref.random_weights(8, 256, 128, seed=0)


def _expect(call, match, **changes):
    inputs, weights = call
    bad = dataclasses.replace(inputs[1], **changes)
    with pytest.raises(MegaMoEInputError, match=match):
        ref.run_reference(CFG, [inputs[0], bad], weights)


def test_wrong_dtype(call):
    _expect(
        call,
        r"argument 'topk_weights': expected dtype torch.float32, got torch.float64",
        topk_weights=call[0][1].topk_weights.double(),
    )


def test_wrong_shape(call):
    _expect(call, r"argument 'x_sf': expected shape \[16, 8\], got \[16, 4\]", x_sf=call[0][1].x_sf[:, :4].contiguous())


def test_wrong_device(call):
    _expect(call, r"argument 'topk_idx': expected device cpu, got meta", topk_idx=call[0][1].topk_idx.to("meta"))


def test_not_contiguous(call):
    w = call[0][1].topk_weights
    _expect(
        call,
        r"argument 'topk_weights': expected a contiguous tensor",
        topk_weights=torch.empty(w.shape[1], w.shape[0]).T.copy_(w),
    )


def test_too_many_tokens(call):
    inp = ref.make_inputs(dataclasses.replace(CFG, max_tokens_per_rank=17), 17)[1]
    _expect(
        call,
        r"argument 'x': expected at most T_max = 16 tokens \(rank 1\), got 17",
        x=inp.x,
        x_sf=inp.x_sf,
        topk_idx=inp.topk_idx,
        topk_weights=inp.topk_weights,
    )


def test_expert_out_of_range(call):
    idx = call[0][1].topk_idx.clone()
    idx[3, 1] = 8
    _expect(call, r"argument 'topk_idx': expected expert ids in \[-1, 8\), got 8 at \[3, 1\]", topk_idx=idx)


def test_duplicate_expert(call):
    idx = call[0][1].topk_idx.clone()
    idx[5] = torch.tensor([2, 2])
    _expect(
        call,
        r"argument 'topk_idx': expected distinct experts within a token, got expert 2 twice in token 5",
        topk_idx=idx,
    )


def test_nan_scale_byte(call):
    sf = call[0][1].x_sf.clone()
    sf[2, 3] = 255
    _expect(
        call, r"argument 'x_sf': expected UE8M0 scale bytes in \[0, 254\] \(255 is NaN\), got 255 at \[2, 3\]", x_sf=sf
    )


def test_nan_weight_scale_byte(call):
    inputs, weights = call
    weights.w2_sf[1, 2, 3] = 255
    with pytest.raises(MegaMoEInputError, match=r"argument 'w2_sf'.*255 at \[1, 2, 3\]"):
        ref.run_reference(CFG, inputs, weights)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("hidden", 200, r"argument 'hidden': expected a positive multiple of 32, got 200"),
        ("intermediate", 100, r"argument 'intermediate': expected a positive multiple of 32, got 100"),
        ("num_experts", 7, r"argument 'num_experts': expected a positive multiple of num_ranks = 2, got 7"),
        ("top_k", 9, r"argument 'top_k': expected a value in \[1, 8\], got 9"),
    ],
)
def test_unsupported_shapes(field, value, match):
    with pytest.raises(MegaMoEInputError, match=match):
        dataclasses.replace(CFG, **{field: value})


def test_misaligned_base_address(call):
    x = ref.as_codes(call[0][1].x)
    storage = torch.zeros(x.numel() + 1, dtype=torch.uint8)
    shifted = storage[1:].view(x.shape)  # contiguous, but one byte past an aligned address
    shifted.copy_(x)
    _expect(
        call,
        r"argument 'x': expected a 16-byte aligned base address, got address 0x[0-9a-f]+ \(offset 1 bytes",
        x=ref.as_float8(shifted),
    )


# ------------------------------------------------------------------------------------------------
# Every public function of megamoe.reference, given a bad argument: one MegaMoEInputError line that
# names the argument as its signature does (SPEC §7), never a raw torch error or a wrong result.
# ------------------------------------------------------------------------------------------------

# Small, valid values the rows below spoil one argument of.
_INPUTS = ref.make_inputs(CFG, 4, seed=1)
_WEIGHTS = ref.random_weights(8, 256, 128, seed=1)
_IDX = _INPUTS[0].topk_idx  # int64 [4, 2]
_CODES = torch.zeros(4, 128, dtype=torch.uint8)
_SF = torch.full((4, 4), 127, dtype=torch.uint8)
_BUF = torch.zeros(2, 4, 256, dtype=torch.bfloat16)  # a combine buffer [K, T_max, H]


def _pool():
    return ref.build_pool(_INPUTS, 0, CFG)


def _meta_x():
    return [dataclasses.replace(_INPUTS[0], x=_INPUTS[0].x.to("meta")), _INPUTS[1]]


def _with(i: int, **changes):
    inputs = list(_INPUTS)
    inputs[i] = dataclasses.replace(inputs[i], **changes)
    return inputs


_P = 64  # rows of the l2_epilogue rows below
_META = torch.zeros(_P, 3, dtype=torch.int32)

# (function, the call, what the error must say)
BAD_INPUTS = [
    ("MoEConfig", lambda: dataclasses.replace(CFG, hidden=256.0), r"'hidden': expected an int, got 256.0 \(float\)"),
    ("MoEConfig", lambda: dataclasses.replace(CFG, hidden="256"), r"'hidden': expected an int, got '256' \(str\)"),
    ("MoEConfig", lambda: dataclasses.replace(CFG, fast_math="false"), r"'fast_math': expected a bool, got 'false'"),
    ("MoEConfig", lambda: dataclasses.replace(CFG, top_k=True), r"'top_k': expected an int, got True \(bool\)"),
    ("MoEConfig", lambda: dataclasses.replace(CFG, activation_clamp="1.5"), r"'activation_clamp': expected None or"),
    ("MoEConfig", lambda: dataclasses.replace(CFG, num_ranks=0), r"'num_ranks': expected a positive rank count"),
    ("check_config", lambda: ref.check_config(CFG.to_dict()), r"'cfg': expected MoEConfig, got dict"),
    ("make_inputs", lambda: ref.make_inputs(CFG, 17), r"'tokens_per_rank': expected an int in \[0, 16\], got 17"),
    ("make_inputs", lambda: ref.make_inputs(CFG, -1), r"'tokens_per_rank': expected an int in \[0, 16\], got -1"),
    ("make_inputs", lambda: ref.make_inputs(CFG, 4.0), r"'tokens_per_rank': expected a list of 2 token counts"),
    ("make_inputs", lambda: ref.make_inputs(CFG, [4]), r"'tokens_per_rank': expected a list of 2 .*, got 1 entries"),
    ("make_inputs", lambda: ref.make_inputs(CFG.to_dict(), 4), r"'cfg': expected MoEConfig, got dict"),
    ("make_inputs", lambda: ref.make_inputs(CFG, 4, seed="0"), r"'seed': expected an int, got '0'"),
    ("make_inputs", lambda: ref.make_inputs(CFG, 4, distribution="zipf"), r"'distribution': expected one of"),
    ("split_global_batch", lambda: ref.split_global_batch(_INPUTS[0], 0), r"'num_ranks': expected an int >= 1"),
    ("split_global_batch", lambda: ref.split_global_batch(_INPUTS, 2), r"'inputs': expected RankInputs, got list"),
    ("random_weights", lambda: ref.random_weights(0, 256, 128), r"'num_experts': expected an int >= 1, got 0"),
    ("random_weights", lambda: ref.random_weights(2, 100, 128), r"'hidden': expected a positive multiple of 32"),
    ("random_weights", lambda: ref.random_weights(2, 256, -128), r"'intermediate': expected an int >= 1"),
    ("random_weights", lambda: ref.random_weights(2, 256.0, 128), r"'hidden': expected an int, got 256.0"),
    ("random_biases", lambda: ref.random_biases(0, 256, 128), r"'num_experts': expected an int >= 1, got 0"),
    ("random_biases", lambda: ref.random_biases(2, 256, 128, seed=1.5), r"'seed': expected an int"),
    ("run_reference", lambda: ref.run_reference(CFG, _INPUTS[0], _WEIGHTS), r"'inputs': expected a list of 2 Rank"),
    ("run_reference", lambda: ref.run_reference(CFG, _INPUTS, None), r"'weights': expected ExpertWeights, got None"),
    ("run_reference", lambda: ref.run_reference(CFG, [_INPUTS[0], "x"], _WEIGHTS), r"'inputs\[1\]': expected Rank"),
    ("run_reference", lambda: ref.run_reference(CFG, _meta_x(), _WEIGHTS), r"'x': expected a tensor with data"),
    ("run_reference", lambda: ref.run_reference(CFG, _INPUTS, _WEIGHTS.to("meta")), r"'w1': expected device cpu"),
    (
        "run_reference",
        lambda: ref.run_reference(CFG, _with(1, x=_INPUTS[1].x.to("meta")), _WEIGHTS),
        r"'x': expected device cpu, got meta",
    ),
    (
        "run_reference",
        lambda: ref.run_reference(CFG, _INPUTS, _WEIGHTS, recv_stats=[torch.zeros(4, dtype=torch.int64)]),
        r"'recv_stats': expected a list of 2 int64",
    ),
    ("run_reference", lambda: ref.run_reference(CFG, _INPUTS, _WEIGHTS, tamper=3), r"'tamper': expected None or a"),
    ("run_oracle", lambda: ref.run_oracle(CFG, _INPUTS[:1], _WEIGHTS), r"'inputs': expected a list of 2 RankInputs"),
    ("check_call", lambda: ref.check_call(CFG, _INPUTS, _WEIGHTS.w1), r"'weights': expected ExpertWeights, got Tensor"),
    ("check_rank_inputs", lambda: ref.check_rank_inputs(CFG, "x"), r"'inp': expected RankInputs, got str"),
    ("check_weights", lambda: ref.check_weights(CFG, _WEIGHTS, 0), r"'num_experts': expected an int >= 1, got 0"),
    (
        "send_counts",
        lambda: ref.send_counts(torch.tensor([[0, 8]]), 8),
        r"'topk_idx': expected expert ids in \[-1, 8\)",
    ),
    ("send_counts", lambda: ref.send_counts(_IDX, 0), r"'num_experts': expected an int >= 1, got 0"),
    ("send_counts", lambda: ref.send_counts(_IDX.float(), 8), r"'topk_idx': expected dtype torch.int64"),
    ("receive_counts", lambda: ref.receive_counts(torch.zeros(2, 8), 2, CFG), r"'rank': expected an int in \[0, 1\]"),
    ("receive_counts", lambda: ref.receive_counts(torch.zeros(2, 7), 0, CFG), r"'all_send_counts': expected an int"),
    ("source_lists", lambda: ref.source_lists([_IDX], 0, CFG), r"'all_topk_idx': expected a list of 2 topk_idx"),
    (
        "source_lists",
        lambda: ref.source_lists([_IDX, torch.zeros(17, 2, dtype=torch.int64)], 0, CFG),
        r"'all_topk_idx\[1\]': expected at most T_max = 16 tokens, got 17",
    ),
    ("build_pool", lambda: ref.build_pool(_INPUTS[0], 0, CFG), r"'all_inputs': expected a list of 2 RankInputs"),
    ("build_pool", lambda: ref.build_pool(_INPUTS, -1, CFG), r"'rank': expected an int in \[0, 1\], got -1"),
    ("pool_offsets", lambda: ref.pool_offsets([3, -1], 16), r"'counts': expected an int >= 0, got -1"),
    ("pool_offsets", lambda: ref.pool_offsets([3], 0), r"'block_m': expected an int >= 1, got 0"),
    (
        "region_valid",
        lambda: ref.region_valid(_SF[0], torch.tensor([3]), 16),
        r"'expert_offsets': expected shape \[2\]",
    ),
    ("region_valid", lambda: ref.region_valid(torch.tensor([0, 16]), torch.tensor([3]), -1), r"'num_rows': expected"),
    ("align_up", lambda: ref.align_up(5, 0), r"'block': expected an int >= 1, got 0"),
    ("l1_gemm", lambda: ref.l1_gemm(_pool(), _WEIGHTS), r"'weights.w1': expected shape \[4, \*, 128\], got \[8, "),
    ("l1_gemm", lambda: ref.l1_gemm(None, _WEIGHTS), r"'pool': expected Pool, got NoneType"),
    ("l1_epilogue", lambda: _l1_epilogue(acc1=torch.zeros(_P, 256, dtype=torch.float16)), r"'acc1': expected dtype"),
    ("l1_epilogue", lambda: _l1_epilogue(acc1=torch.zeros(_P, 96)), r"'acc1': expected \[P, 2I\] with I a multiple"),
    ("l1_epilogue", lambda: _l1_epilogue(valid=torch.ones(_P)), r"'valid': expected dtype torch.bool"),
    ("l1_epilogue", lambda: _l1_epilogue(activation_clamp=-1.0), r"'activation_clamp': expected None or a positive"),
    ("l1_epilogue", lambda: _l1_epilogue(fast_math="yes"), r"'fast_math': expected a bool, got 'yes'"),
    (
        "swiglu",
        lambda: ref.swiglu(torch.zeros(_P, 256), torch.ones(3), activation_clamp=None, fast_math=True),
        r"'route_weights': expected shape \[64\], got \[3\]",
    ),
    ("l1_done", lambda: ref.l1_done(torch.ones(4), 128), r"'block_arrivals': expected an integer tensor"),
    (
        "l1_done",
        lambda: ref.l1_done(torch.ones(4, dtype=torch.int32), 48),
        r"'intermediate': expected a multiple of 32",
    ),
    (
        "l2_gemm",
        lambda: ref.l2_gemm(torch.zeros(3, 128, dtype=torch.uint8), _SF, _pool(), _WEIGHTS.slice(0, 4)),
        r"'l2_acts': expected shape \[\d+, \*\], got \[3, 128\]",
    ),
    ("empty_combine_buffer", lambda: ref.empty_combine_buffer(0, 4, 256), r"'top_k': expected an int >= 1, got 0"),
    ("empty_combine_buffer", lambda: ref.empty_combine_buffer(2, -1, 256), r"'max_tokens': expected an int >= 0"),
    ("l2_epilogue", lambda: _l2_epilogue(acc2=torch.zeros(_P, 256, dtype=torch.float16)), r"'acc2': expected dtype"),
    ("l2_epilogue", lambda: _l2_epilogue(combine_buffers=[]), r"'combine_buffers': expected a list of combine"),
    ("l2_epilogue", lambda: _l2_epilogue(meta=_META + torch.tensor([0, 9, 0], dtype=torch.int32)), r"'meta': expected"),
    (
        "combine",
        lambda: ref.combine(_BUF, torch.zeros(4, 3, dtype=torch.int64)),
        r"'topk_idx': expected shape \[\*, 2\]",
    ),
    ("combine", lambda: ref.combine(_BUF, torch.zeros(5, 2, dtype=torch.int64)), r"'topk_idx': expected at most T_max"),
    ("combine", lambda: ref.combine(_BUF.float(), _IDX), r"'combine_buffer': expected dtype torch.bfloat16"),
    ("combine_f64", lambda: ref.combine_f64(_BUF[:1], _IDX), r"'topk_idx': expected shape \[\*, 1\], got \[4, 2\]"),
    (
        "updated_recv_stats",
        lambda: ref.updated_recv_stats(torch.zeros(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32)),
        r"'recv_stats_before': expected dtype torch.int64",
    ),
    ("updated_recv_stats", lambda: ref.updated_recv_stats(None, torch.ones(3)), r"'recv_totals': expected an integer"),
    (
        "swiglu_f64",
        lambda: ref.swiglu_f64(torch.zeros(_P, 5), torch.ones(_P), torch.ones(_P, dtype=torch.bool), None),
        r"'acc1': expected \[P, 2I\] \(gate and up\), got \[64, 5\]",
    ),
    ("calc_diff", lambda: ref.calc_diff(torch.zeros(3), torch.zeros(4)), r"'y': expected shape \[3\], got \[4\]"),
    ("block_scaled_gemm", lambda: ref.block_scaled_gemm(_CODES, _SF, _CODES, _SF), r"'b_packed': expected shape"),
    (
        "block_scaled_gemm_f64",
        lambda: ref.block_scaled_gemm_f64(_CODES[:, :48], _SF, _CODES, _SF),
        r"'a_codes': expected \[M, K\] with K a multiple of 32, got \[4, 48\]",
    ),
    (
        "fast_gemm_f64",
        lambda: ref.fast_gemm_f64(_CODES[:, :64], _SF[:, :2], _CODES[:, :32], _SF[:, :2]),
        r"'a_codes': expected \[M, K\] with K a multiple of 128, got \[4, 64\]",
    ),
    (
        "grouped_gemm",
        lambda: ref.grouped_gemm(
            _CODES,
            _SF,
            torch.tensor([0, 4, 2]),
            _CODES[:2, :64].reshape(2, 1, 64).expand(2, 1, 64),
            _SF[:2, None],
            valid=torch.ones(4, dtype=torch.bool),
        ),
        r"'expert_offsets': expected ascending pool rows in \[0, 4\], got \[0, 4, 2\]",
    ),
    ("valid_rows", lambda: ref.valid_rows({}), r"'dump': expected the tensors D4.expert_offsets"),
    ("check_dump_tensors", lambda: ref.check_dump_tensors([], {}), r"'tensors': expected Mapping, got list"),
    ("dump_problems", lambda: ref.dump_problems({}, {}, ["D11"]), r"'points': expected dump points of the table"),
    ("dump_dims", lambda: ref.dump_dims(CFG, tokens=-1, pool_rows=0), r"'tokens': expected an int >= 0, got -1"),
    (
        "quantize_activations",
        lambda: ref.quantize_activations(torch.zeros(2, 48)),
        r"'x': expected a tensor \[\.\.\., K\]",
    ),
    ("quantize_activations", lambda: ref.quantize_activations(torch.zeros(2, 32).double()), r"'x': .*rounded twice"),
    ("quantize_weights", lambda: ref.quantize_weights(torch.full((2, 32), float("inf"))), r"'w': expected finite"),
    ("quantize_weights", lambda: ref.quantize_weights([1.0] * 32), r"'w': expected a torch.Tensor, got list"),
    ("requantize_intermediate", lambda: ref.requantize_intermediate(_CODES), r"'a': expected a floating-point tensor"),
    ("dequantize_e4m3", lambda: ref.dequantize_e4m3(_CODES, _SF[:, :3]), r"'scale_bytes': expected shape \[4, 4\]"),
    ("dequantize_e4m3", lambda: ref.dequantize_e4m3(_CODES, _SF, torch.int32), r"'dtype': expected a floating-point"),
    ("dequantize_fp4", lambda: ref.dequantize_fp4(_CODES.float(), _SF), r"'packed': expected dtype torch.uint8"),
    ("rebase_k128", lambda: ref.rebase_k128(_CODES[:, :64], _SF), r"'codes': expected a tensor \[\.\.\., K\] with K a"),
    ("rebase_k128", lambda: ref.rebase_k128(_CODES, _SF[:, :2]), r"'scale_bytes': expected shape \[4, 4\]"),
    ("as_codes", lambda: ref.as_codes(torch.zeros(2)), r"'x': expected dtype torch.uint8 or torch.float8_e4m3fn"),
    ("as_float8", lambda: ref.as_float8(_IDX), r"'codes': expected dtype torch.uint8 or torch.float8_e4m3fn"),
    ("bf16_bits", lambda: ref.bf16_bits(torch.zeros(2)), r"'x': expected dtype torch.bfloat16, got torch.float32"),
    ("bf16_tensor", lambda: ref.bf16_tensor(torch.zeros(2)), r"'bits': expected an integer tensor"),
    ("ceil_exponent", lambda: ref.ceil_exponent(torch.ones(2, dtype=torch.int32)), r"'v': expected a floating-point"),
    ("decode_bf16", lambda: ref.decode_bf16(torch.zeros(2)), r"'bits': expected an integer tensor"),
    ("decode_e2m1", lambda: ref.decode_e2m1(torch.zeros(2)), r"'codes': expected an integer tensor"),
    ("decode_e4m3", lambda: ref.decode_e4m3(_IDX), r"'codes': expected dtype torch.uint8 or torch.float8_e4m3fn"),
    ("decode_ue8m0", lambda: ref.decode_ue8m0(_SF, torch.int32), r"'dtype': expected a floating-point torch.dtype"),
    ("decode_ue8m0", lambda: ref.decode_ue8m0(_SF.int()), r"'scale_bytes': expected dtype torch.uint8"),
    ("encode_bf16", lambda: ref.encode_bf16([1.0]), r"'x': expected a torch.Tensor, got list"),
    ("encode_e2m1", lambda: ref.encode_e2m1(torch.zeros(2).double()), r"'x': expected float32, bfloat16 or float16"),
    ("encode_e4m3", lambda: ref.encode_e4m3(_IDX), r"'x': expected a floating-point tensor, got torch.int64"),
    ("round_bf16", lambda: ref.round_bf16(torch.zeros(2).double()), r"'x': expected float32, bfloat16 or float16"),
    ("pack_fp4", lambda: ref.pack_fp4(_CODES[:, :3]), r"'codes': expected an even last dimension"),
    ("pack_fp4", lambda: ref.pack_fp4(torch.tensor(3)), r"'codes': expected a tensor of at least 1 dimension"),
    ("unpack_fp4", lambda: ref.unpack_fp4(_IDX), r"'packed': expected dtype torch.uint8, got torch.int64"),
    ("pack_ue8m0", lambda: ref.pack_ue8m0(_SF[:, :3]), r"'scale_bytes': expected a last dimension .* multiple of 4"),
    ("unpack_ue8m0", lambda: ref.unpack_ue8m0(torch.zeros(2)), r"'words': expected an integer tensor"),
    ("stable_topk", lambda: ref.stable_topk(torch.zeros(2, 4), 5), r"'k': expected an int in \[1, 4\], got 5"),
    ("softmax_topk", lambda: ref.softmax_topk(_IDX, 1), r"'logits': expected a floating-point tensor"),
    ("softmax_topk", lambda: ref.softmax_topk(torch.zeros(2, 4), 0), r"'k': expected an int in \[1, 4\], got 0"),
    (
        "deepseek_v3_topk",
        lambda: ref.deepseek_v3_topk(torch.zeros(2, 8), torch.zeros(8), 2, n_group=3, topk_group=1),
        r"'n_group': expected a divisor of the 8 experts into groups of at least 2, got 3",
    ),
    (
        "deepseek_v3_topk",
        lambda: ref.deepseek_v3_topk(torch.zeros(2, 8), torch.zeros(8), 2, n_group=4, topk_group=5),
        r"'topk_group': expected an int in \[1, 4\], got 5",
    ),
    (
        "deepseek_v3_topk",
        lambda: ref.deepseek_v3_topk(torch.zeros(2, 8), torch.zeros(7), 2, n_group=4, topk_group=2),
        r"'correction_bias': expected shape \[8\]",
    ),
    ("make_routing", lambda: ref.make_routing(4, 8, 9), r"'k': expected an int in \[1, 8\], got 9"),
    ("make_routing", lambda: ref.make_routing(-1, 8, 2), r"'num_tokens': expected an int >= 0, got -1"),
    ("make_routing", lambda: ref.make_routing(4, 8, 2, masked_ratio="0.5"), r"'masked_ratio': expected a fraction"),
    ("tie_free_logits", lambda: ref.tie_free_logits(4, 8, generator=None), r"'generator': expected Generator"),
    ("silu_table", lambda: ref.silu_table("false"), r"'fast_math': expected a bool, got 'false'"),
    ("glu_table", lambda: ref.glu_table(1), r"'fast_math': expected a bool, got 1"),
    ("gpt_oss_topk", lambda: ref.gpt_oss_topk(torch.zeros(2, 4), 5), r"'k': expected an int in \[1, 4\], got 5"),
    (
        "bias_rows",
        lambda: ref.bias_rows(torch.zeros(3, 4), torch.zeros(4, dtype=torch.int32), 5),
        r"'bias': expected dtype torch.bfloat16",
    ),
    (
        "add_l2_bias",
        lambda: ref.add_l2_bias(
            torch.zeros(2, 4), b2=torch.zeros(2, 4, dtype=torch.bfloat16), route_weights=torch.ones(3)
        ),
        r"'route_weights': expected shape \[2\], got \[3\]",
    ),
    ("activation_args", lambda: ref.activation_args(ref.DEFAULT_CONFIG.to_dict(), {}, None), r"'cfg': expected MoE"),
    ("l2_bias_args", lambda: ref.l2_bias_args(ref.DEFAULT_CONFIG, [], None), r"'dump': expected a dict of dump"),
    ("interleave_gate_up", lambda: ref.interleave_gate_up(_CODES), r"'rows': expected shape \[\*, \*, \*\]"),
    ("deinterleave_gate_up", lambda: ref.deinterleave_gate_up(_CODES[None, :24]), r"'rows': expected \[E, 2I, X\]"),
]


def _l1_epilogue(**changes):
    args = dict(
        acc1=torch.zeros(_P, 256),
        route_weights=torch.ones(_P),
        valid=torch.ones(_P, dtype=torch.bool),
        activation_clamp=None,
        fast_math=True,
    )
    args.update(changes)
    return ref.l1_epilogue(**args)


def _l2_epilogue(**changes):
    args = dict(acc2=torch.zeros(_P, 256), meta=_META, valid=torch.ones(_P, dtype=torch.bool), combine_buffers=[_BUF])
    args.update(changes)
    return ref.l2_epilogue(**args)


@pytest.mark.parametrize("function,call,match", BAD_INPUTS, ids=[f"{row[0]}-{i}" for i, row in enumerate(BAD_INPUTS)])
def test_every_public_reference_function_refuses_a_bad_argument_in_one_line_naming_it(function, call, match):
    with pytest.raises(MegaMoEInputError, match=r"^argument " + match) as e:
        call()
    assert "\n" not in str(e.value)


def test_the_bad_input_table_has_a_row_for_every_public_function_of_the_reference():
    import inspect

    functions = {n for n in ref.__all__ if inspect.isfunction(getattr(ref, n))} | {"MoEConfig"}
    missing = functions - {row[0] for row in BAD_INPUTS}
    assert not missing, sorted(missing)
