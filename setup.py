"""The one compiled piece: the shared-memory reduction kernel (phalanx/shm/_reduce_kernels.c).

It is optional: without a C compiler the install still succeeds and phalanx reduces with torch ops
(slower, same bits). Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("phalanx.shm._reduce_kernels", ["phalanx/shm/_reduce_kernels.c"],
                             extra_compile_args=["-O3", "-ffp-contract=off"], optional=True)])
