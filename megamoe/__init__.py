"""megamoe — a fused FP8 x MXFP4 Mixture-of-Experts megakernel for H200, with its bit-exact
reference (`megamoe.reference`) and conformance suite (`megamoe.conformance`)."""

__version__ = "0.1.0"
