"""JIT for the SM90 kernels: specialise, compile with nvcc, cache the cubin, launch from Python.

* build.py   - turns a specialisation (layer, token tile, stages, modes) into a cubin with nvcc,
               cached under $MEGAMOE_CACHE_DIR (default ~/.cache/megamoe) by a hash of every kernel
               source, the nvcc flags and the specialisation; a failing nvcc raises CompileError with
               nvcc's own message.
* driver.py  - the CUDA driver API through ctypes (libcuda.so.1): module load, launch, TMA
               descriptors. Why ctypes and not cuda-bindings: the driver's C ABI is stable and is all
               we need (seven entry points), it is present wherever a GPU is, and it keeps the
               launch path free of a second binding library whose Python signatures change between
               releases; torch owns the context and the stream, we only borrow them.
* layout.py  - the kernel's weight layout (transform_weights and its inverse).

Its modules are imported on first use (megamoe._submodule_getattr), as the docs name them
(megamoe.jit.layout.transform_weights after a bare `import megamoe`).
"""

from megamoe import _submodule_getattr

__getattr__ = _submodule_getattr(__name__)
