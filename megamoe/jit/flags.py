"""The nvcc flags every megamoe CUDA build uses: the kernel, the SiLU table probe, the CI compile gate.

One definition, because the SiLU tables shipped with the reference are only valid for code built
with the same floating-point flags as the kernel (no fast-math, IEEE division, no FTZ by default:
the approximate instructions the kernel wants are written explicitly in the sources).
"""

ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a"]

FLOAT_FLAGS = ["-ftz=false", "-prec-div=true", "-prec-sqrt=true"]

NVCC_FLAGS = ["-O3", "-std=c++17", *FLOAT_FLAGS, *ARCH_FLAGS]
