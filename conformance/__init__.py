"""megamoe.conformance — stage checkers for the kernel's dump points (SPEC §4, §5).

Two layers (tests/test_package_hygiene.py holds them): `dump`, the dump format, imports only the
reference, and the fused layer's debug path (megamoe.moe) makes its dumps with it; every other
module is a checker, which the library's runtime never imports.

Its modules are imported on first use (megamoe._submodule_getattr): the pytest plugin loads this
package in every pytest run of the venv, `megamoe.conformance.suite.check` resolves after a bare
`import megamoe`, and importing `megamoe.conformance.dump` imports no checker."""

from megamoe import _submodule_getattr

__getattr__ = _submodule_getattr(__name__)
