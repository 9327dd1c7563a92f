"""What ``torch.compile`` needs on a machine besides torch: a C or C++ compiler."""

from __future__ import annotations

import os
import shutil

from raytrain_mnist.errors import ConfigError


def compiler_missing(use_gpu: bool) -> str | None:
    """What ``torch.compile`` lacks on this machine to build its kernels, or None: on CPU
    Inductor compiles C++ with ``$CXX``, else ``g++``; on GPU Triton builds its launchers with
    ``$CC``, else ``gcc`` or ``clang``. Without one the first step fails."""
    if use_gpu:
        cc = os.environ.get("CC", "").strip()
        names = [cc] if cc else ["gcc", "clang"]
        what = f"a C compiler for Triton ({f'$CC is {cc!r}' if cc else 'gcc or clang, or $CC'})"
    else:
        cxx = os.environ.get("CXX", "").strip()
        names = [cxx or "g++"]
        what = f"a C++ compiler for Inductor ({f'$CXX is {cxx!r}' if cxx else 'g++, or $CXX'})"
    return None if any(shutil.which(name.split()[0]) for name in names) else what


def check_compiler(use_gpu: bool) -> None:
    """Refuse ``--compile`` where :func:`compiler_missing` finds no compiler, in one line."""
    missing = compiler_missing(use_gpu)
    if missing is not None:
        raise ConfigError(
            f"--compile needs {missing} and finds none here; install one "
            "(Debian: apt-get install g++), set the variable, or drop --compile"
        )
