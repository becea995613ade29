"""ember's C++ extension (built as ember._native), loaded the safe way.

oneDNN first: torch's own libraries export copies of libstdc++ template code (std::call_once's helpers
among them) built with another compiler. Loaded the ordinary way, libdnnl.so binds to those copies and,
with torch 2.11's CUDA wheels, crashes in its first dnnl_primitive_create (seen on the GPU machine:
SIGSEGV in std::once_flag::_Prepare_execution from libtorch_cpu.so). Loading it first with RTLD_DEEPBIND
makes it resolve against itself and its own dependencies; the extension's link to it then reuses that
copy. A C++ program is affected where libtorch comes before libdnnl in its search order: on an AVX2-only host
libdnnl's f32 matmuls with post-ops ran torch's copy of gemm_info_t's initialization and refused to execute
(ember then runs them through ATen). ember's C++ tests link libdnnl first (test/cpp/CMakeLists.txt).
"""

import ctypes
import os

from ._build_info import ONEDNN_LIBRARY

_onednn = None
if ONEDNN_LIBRARY and hasattr(os, "RTLD_DEEPBIND"):
    try:
        _onednn = ctypes.CDLL(ONEDNN_LIBRARY, mode=os.RTLD_DEEPBIND | os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError:  # moved since the build: the extension's own link finds it (or says why not)
        _onednn = None

from ._native import *  # noqa: E402,F401,F403
from ._native import __doc__  # noqa: E402,F401
from ._native import set_config as _set_config  # noqa: E402

from . import config as _config  # noqa: E402

_config.push_all(_set_config)  # C++ reads the settings ember.config holds (backend/include/ember/config.h)
