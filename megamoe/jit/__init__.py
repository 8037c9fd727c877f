"""megamoe.jit — building and launching the CUDA kernels (nvcc flags, cache, launch)."""
