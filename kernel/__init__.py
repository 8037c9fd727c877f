"""CUDA sources of the megamoe kernel (package data of `megamoe.kernel`); built by megamoe.jit."""
