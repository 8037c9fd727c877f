"""megamoe.reference — the bit-exact pure-PyTorch reference of every stage of SPEC §3.

Runs on CPU or CUDA tensors alike. Stages, in the project's vocabulary:
    dispatch (D1-D3)  send_counts, receive_counts, source_lists
    pool (D4)         build_pool, Pool
    L1 (D5)           l1_gemm
    SwiGLU/requant    l1_epilogue, swiglu, l1_done (D6); bias_rows (SPEC §8's biases per pool row)
    L2 (D7, D8)       l2_gemm, l2_epilogue
    combine (D9)      combine
    cleanup (D10)     updated_recv_stats
and `run_reference` runs them all for R ranks in one process. `points` is the dump-point table:
every dump tensor's name, stage, dtype, shape and check class, and `check_dump_tensors`.
"""

from .cleanup import updated_recv_stats
from .combine import combine
from .config import ACTIVATIONS, DEFAULT_CONFIG, GPT_OSS_ALPHA, GPT_OSS_LIMIT, MoEConfig, check_config
from .dispatch import Pool, align_up, build_pool, pool_offsets, receive_counts, region_valid, send_counts, source_lists
from .errors import MegaMoEInputError
from .formats import (
    as_codes,
    as_float8,
    bf16_bits,
    bf16_tensor,
    ceil_exponent,
    decode_bf16,
    decode_e2m1,
    decode_e4m3,
    decode_ue8m0,
    encode_bf16,
    encode_e2m1,
    encode_e4m3,
    pack_fp4,
    pack_ue8m0,
    round_bf16,
    unpack_fp4,
    unpack_ue8m0,
)
from .gemm import block_scaled_gemm, block_scaled_gemm_f64, fast_gemm_f64, grouped_gemm
from .inputs import RankInputs, make_inputs, split_global_batch
from .l1 import l1_gemm
from .l2 import add_l2_bias, empty_combine_buffer, l2_epilogue, l2_gemm
from .oracle import OracleRank, calc_diff, combine_f64, run_oracle, swiglu_f64
from .pipeline import POINTS, ReferenceResult, StageContext, activation_args, l2_bias_args, run_reference, valid_rows
from . import points
from .points import DumpPoint, DumpTensor, check_dump_tensors, dump_dims, dump_problems
from .quantize import (
    Quantized,
    dequantize_e4m3,
    dequantize_fp4,
    quantize_activations,
    quantize_weights,
    rebase_k128,
    requantize_intermediate,
)
from .routing import (
    DISTRIBUTIONS,
    Routing,
    deepseek_v3_topk,
    gpt_oss_topk,
    make_routing,
    softmax_topk,
    stable_topk,
    tie_free_logits,
)
from .silu_tables import glu_table, silu_table
from .swiglu import L1Output, bias_rows, l1_done, l1_epilogue, swiglu
from .threads import limit_torch_threads as _limit_torch_threads
from .validate import check_call, check_rank_inputs, check_weights
from .weights import ExpertWeights, deinterleave_gate_up, interleave_gate_up, random_biases, random_weights

# The reference is the CPU work of this project: keep torch's thread pool within the cores this
# process really has (megamoe.reference.threads says why), as the CLI and the tests do.
_limit_torch_threads()

# Written out, not computed: a reader (and a linter) sees the public API without running the file.
__all__ = [
    "updated_recv_stats",
    "combine",
    "ACTIVATIONS",
    "DEFAULT_CONFIG",
    "GPT_OSS_ALPHA",
    "GPT_OSS_LIMIT",
    "MoEConfig",
    "check_config",
    "Pool",
    "align_up",
    "build_pool",
    "pool_offsets",
    "receive_counts",
    "region_valid",
    "send_counts",
    "source_lists",
    "as_codes",
    "as_float8",
    "bf16_bits",
    "bf16_tensor",
    "ceil_exponent",
    "decode_bf16",
    "decode_e2m1",
    "decode_e4m3",
    "decode_ue8m0",
    "encode_bf16",
    "encode_e2m1",
    "encode_e4m3",
    "pack_fp4",
    "pack_ue8m0",
    "round_bf16",
    "unpack_fp4",
    "unpack_ue8m0",
    "block_scaled_gemm",
    "block_scaled_gemm_f64",
    "fast_gemm_f64",
    "grouped_gemm",
    "RankInputs",
    "make_inputs",
    "split_global_batch",
    "l1_gemm",
    "empty_combine_buffer",
    "l2_epilogue",
    "add_l2_bias",
    "l2_gemm",
    "OracleRank",
    "calc_diff",
    "combine_f64",
    "run_oracle",
    "swiglu_f64",
    "POINTS",
    "points",
    "DumpPoint",
    "DumpTensor",
    "check_dump_tensors",
    "dump_dims",
    "dump_problems",
    "ReferenceResult",
    "StageContext",
    "run_reference",
    "activation_args",
    "l2_bias_args",
    "valid_rows",
    "Quantized",
    "dequantize_e4m3",
    "dequantize_fp4",
    "quantize_activations",
    "quantize_weights",
    "rebase_k128",
    "requantize_intermediate",
    "DISTRIBUTIONS",
    "Routing",
    "deepseek_v3_topk",
    "gpt_oss_topk",
    "make_routing",
    "softmax_topk",
    "stable_topk",
    "tie_free_logits",
    "silu_table",
    "glu_table",
    "L1Output",
    "l1_done",
    "l1_epilogue",
    "bias_rows",
    "swiglu",
    "MegaMoEInputError",
    "check_call",
    "check_rank_inputs",
    "check_weights",
    "ExpertWeights",
    "deinterleave_gate_up",
    "interleave_gate_up",
    "random_weights",
    "random_biases",
]
