"""megamoe — a fused FP8 x MXFP4 Mixture-of-Experts megakernel for H200, with its bit-exact
reference (`megamoe.reference`) and conformance suite (`megamoe.conformance`).

The public API, `__all__`, one line each:

    MegaMoE            the fused layer of one rank: one persistent launch per call, D1-D10 (megamoe.moe)
    MoEConfig          a layer's shape and mode: H, I, E, K, R, T_max, clamp, SiLU (SPEC §2)
    ExpertWeights      canonical FP4 weights w1, w1_sf, w2, w2_sf of all E experts (SPEC §2)
    RankInputs         one rank's x, x_sf, topk_idx, topk_weights (SPEC §2)
    MegaMoEInputError  the one error of bad input: names the argument, expected, actual (SPEC §7)
    reference          the bit-exact PyTorch reference of every stage, CPU or CUDA (reference/)
    conformance        the stage checkers of D1-D10, dump files, `conformance.suite.check` (conformance/)
    gemm               the SM90 grouped GEMMs L1 and L2 with their fused epilogues, standalone
    moe                the fused layer's module (MegaMoE, choose_engine)
    ops                the fused layer as the torch.library op torch.ops.megamoe.moe_layer
    multirank          R ranks as R processes on one host (spawn)
    jit                the kernels' build, cache and launch; the kernel weight layout (jit.layout)

Every name is imported on first use (PEP 562 `__getattr__`), so `import megamoe` imports neither
torch nor a submodule, and needs no GPU and no nvcc. Each submodule the docs name (megamoe.cli,
megamoe.ranks, megamoe.silu_probe, ...) is reachable the same way, by attribute.
"""

import importlib as _importlib

__version__ = "0.1.0"

# Written out, not computed: a reader (and a linter) sees the public API without running the file.
__all__ = [
    "MegaMoE",
    "MoEConfig",
    "ExpertWeights",
    "RankInputs",
    "MegaMoEInputError",
    "reference",
    "conformance",
    "gemm",
    "moe",
    "ops",
    "multirank",
    "jit",
]

# The module each class of the public API is defined in (the other names are submodules).
_HOMES = {
    "MegaMoE": "megamoe.moe",
    "MoEConfig": "megamoe.reference",
    "ExpertWeights": "megamoe.reference",
    "RankInputs": "megamoe.reference",
    "MegaMoEInputError": "megamoe.reference",
}


def _submodule_getattr(package: str, homes: dict[str, str] | None = None):
    """A module `__getattr__` (PEP 562) for `package`: a name of `homes` is taken from its module,
    any other public name is `package`'s submodule of that name, imported on first use, so a
    package's __init__ stays cheap and its documented dotted names (megamoe.conformance.suite.check)
    still resolve after a bare import."""

    def __getattr__(name: str):
        if homes and name in homes:
            return getattr(_importlib.import_module(homes[name]), name)
        if not name.startswith("_"):  # dunders (__path__ probes, __main__) are never submodules to import
            try:
                return _importlib.import_module(f"{package}.{name}")  # also binds it on the package
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise  # a submodule that exists but imports something missing
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


__getattr__ = _submodule_getattr(__name__, _HOMES)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
