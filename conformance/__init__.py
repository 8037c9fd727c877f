"""megamoe.conformance — stage checkers for the kernel's dump points (SPEC §4, §5).

Its modules are imported on first use (megamoe._submodule_getattr): the pytest plugin loads this
package in every pytest run of the venv, and `megamoe.conformance.suite.check` resolves after a
bare `import megamoe`."""

from megamoe import _submodule_getattr

__getattr__ = _submodule_getattr(__name__)
