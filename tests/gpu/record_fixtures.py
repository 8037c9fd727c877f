"""Record the kernel's dumps of two small calls on a GPU, as CI fixtures (SPEC §5: a dump captured on
a GPU is checked later on a CPU).

    python -m tests.gpu.record_fixtures OUT_DIR

writes OUT_DIR/sm90_<promotion>_rank<r>.pt for promotion k32 (H 256, I 128) and k128 (H 512, I 512).
tests/test_fixtures.py checks them with the conformance suite on every CI run.
"""

import sys
from pathlib import Path

import torch

from megamoe import reference as ref

from .test_gemm_conformance import kernel_dumps

CALLS = {
    "k32": ref.MoEConfig(
        hidden=256,
        intermediate=128,
        num_experts=8,
        top_k=4,
        num_ranks=2,
        max_tokens_per_rank=32,
        block_m=64,
        activation_clamp=1.5,
        fast_math=True,
    ),
    "k128": ref.MoEConfig(
        hidden=512,
        intermediate=512,
        num_experts=4,
        top_k=2,
        num_ranks=2,
        max_tokens_per_rank=16,
        block_m=64,
        activation_clamp=None,
        fast_math=False,
    ),
}


def main(out: Path) -> None:
    if not torch.cuda.is_available():
        sys.exit("record_fixtures needs a CUDA GPU (it records the kernel's own dumps)")
    out.mkdir(parents=True, exist_ok=True)
    for promotion, cfg in CALLS.items():
        inputs = [
            i.to("cuda")
            for i in ref.make_inputs(
                cfg,
                [cfg.max_tokens_per_rank, cfg.max_tokens_per_rank - 5],
                seed=1,
                distribution="skewed",
                masked_ratio=0.1,
            )
        ]
        weights = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=1, device="cuda")
        for d in kernel_dumps(cfg, inputs, weights, promotion):
            d.meta["build_id"] = f"sm90 standalone GEMMs, {torch.cuda.get_device_name()}, torch {torch.__version__}"
            d.save(out / f"sm90_{promotion}_rank{d.rank}.pt")
            print(out / f"sm90_{promotion}_rank{d.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
