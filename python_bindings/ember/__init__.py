"""ember: a torch.compile backend written in C++.

    model = torch.compile(model, backend="ember")
    ember.export(model, (x,), "model.ember")      # a package for C++ (ember::load), no Python needed

Importing ember is cheap: the C++ extension, AOTAutograd and the decomposition table load on the
first compile, not here.
"""

from .errors import EmberError

__version__ = "0.1.0"
__all__ = ["EmberError", "ember_backend", "explain", "export", "load", "wait_for_compiles", "__version__"]


def wait_for_compiles():
    """Waits until the CUDA kernels ember is still compiling in the background have loaded.

    Fused CUDA kernels that no cache holds compile on threads of their own, and until one has loaded, calls
    run its group's ATen ops instead (kernels/cuda/cuda_kernel.h); calls after this run the kernels.
    Returns at once where nothing is compiling. EMBER_CUDA_BACKGROUND=0 compiles everything before the
    first call instead."""
    from . import _C

    _C.wait_for_kernel_compiles()


def __getattr__(name):
    if name == "ember_backend":
        from .backend import ember_backend

        return ember_backend
    if name == "explain":
        from .report import explain

        return explain
    if name in ("export", "load"):
        import importlib

        export_module = importlib.import_module(".export", __name__)

        # Importing the submodule ember.export bound the name to the module; the function takes it back.
        globals()["export"], globals()["load"] = export_module.export, export_module.load
        return globals()[name]
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
