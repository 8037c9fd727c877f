"""megamoe.conformance — stage checkers for the kernel's dump points (SPEC §4, §5)."""
