"""ember: a torch.compile backend written in C++.

    model = torch.compile(model, backend="ember")   # registered on install; no `import ember` needed
    print(ember.explain(model)(x))                  # what compiled, fused, fell back, and where time went
    ember.export(model, (x,), "model.ember")        # a package for C++ (ember::load), no Python needed
    ember.config.fallback = "raise"                 # settings: docs/configuration.md, ember.config.patch(...)
    package = ember.load("model.ember", "cpu")      # the same package from Python: package.run([x])

Public API:
    explain(fn, mode=, options=, dynamic=)   compile fn afresh, call it once, return a report
    export(model, example_inputs, path, ...) write a package that C++ ember::load runs
    load(path, device="cpu")                 load a package through the C++ loader
    wait_for_compiles()                      wait for fused CUDA kernels compiling in the background
    config                                   every setting, typed (ember/config.py, docs/configuration.md)
    cache.clear(), cache.entries()           the compile cache on disk (ember/cache.py)
    save_cache_artifacts()                   the compile and kernel caches as bytes, for another machine
    load_cache_artifacts(data)               install those bytes into this machine's caches
    EmberError                               what ember raises for a graph, option or package it cannot handle
    ember_backend                            the backend function itself (torch.compile(backend=ember.ember_backend))

A failed compile surfaces at the compiled function's first call as torch._dynamo.exc.BackendCompilerFailed
(Dynamo wraps the backend's exception); the EmberError is its `inner_exception`:

    try:
        out = compiled(x)
    except torch._dynamo.exc.BackendCompilerFailed as e:
        if not isinstance(e.inner_exception, ember.EmberError):
            raise
        ...  # e.inner_exception names the node or option

Importing ember is cheap: the C++ extension, AOTAutograd and the decomposition table load on the
first compile, not here.
"""

from . import cache, config
from .errors import EmberError

__version__ = "0.1.0"
__all__ = ["EmberError", "cache", "config", "ember_backend", "explain", "export", "load", "load_cache_artifacts",
           "save_cache_artifacts", "wait_for_compiles", "__version__"]


def save_cache_artifacts():
    """The compile cache's entries and the CUDA kernels compiled so far, as bytes (in the spirit of
    torch.compiler.save_cache_artifacts): load_cache_artifacts installs them on another machine, so that its
    first compiles of the same graphs skip tracing and kernel compiles. What must match there: ember/cache.py."""
    return cache.save_artifacts()


def load_cache_artifacts(data):
    """Installs bytes from save_cache_artifacts into this machine's caches; returns how many files it wrote.
    EmberError for bytes that are not such artifacts."""
    return cache.load_artifacts(data)


def wait_for_compiles():
    """Waits until the CUDA kernels ember is still compiling in the background have loaded.

    Fused CUDA kernels that no cache holds compile on threads of their own, and until one has loaded, calls
    run its group's ATen ops instead (kernels/cuda/cuda_kernel.h); calls after this run the kernels.
    Returns at once where nothing is compiling. ember.config.cuda_background = False (EMBER_CUDA_BACKGROUND=0)
    compiles everything before the first call instead."""
    from . import _C

    _C.wait_for_kernel_compiles()


def explain(fn, *, mode=None, options=None, dynamic=None):
    """Returns a function that compiles `fn` with ember afresh (torch._dynamo.reset() first), calls it once
    with its arguments and returns the report: graphs compiled and fallen back, each graph's fused kernels,
    ATen calls and fast paths, and the compile time split by stage. print() it.

        print(ember.explain(model)(x))
        print(ember.explain(model, mode="reduce-overhead")(x))
    """
    from .report import explain as _explain

    return _explain(fn, mode=mode, options=options, dynamic=dynamic)


def _export_module():
    import importlib

    module = importlib.import_module(".export", __name__)
    # Importing the submodule ember.export binds the name `export` in this package to the module; the
    # function below takes the name back.
    globals()["export"] = _export_function
    return module


def export(model, example_inputs, path, dynamic_shapes=None, device=None, strict=False, disable_passes=()):
    """Exports `model` (an nn.Module, or a torch.export.ExportedProgram) to the package file `path`, which
    C++ loads with ember::load (include/ember/model.h) and Python with ember.load.

    example_inputs: a tuple of tensors (the model's positional inputs). dynamic_shapes: as for
    torch.export.export. device: where the package runs ("cpu", "cuda", "cuda:1"); default: the device
    of the example inputs. A module is moved there on a copy, so the caller's model is left alone.
    Returns a dict: the package size, the number of CUDA kernel images, and the seconds each step took.
    Raises EmberError for a model ember cannot compile.
    """
    return _export_module().export(model, example_inputs, path, dynamic_shapes=dynamic_shapes, device=device,
                                   strict=strict, disable_passes=disable_passes)


_export_function = export


def load(path, device="cpu", reduce_overhead=False):
    """Loads a package written by ember.export through the C++ loader; `.run(list of tensors)` returns a list
    of tensors. reduce_overhead=True replays the model's CUDA work through CUDA graphs (CUDA devices only).
    A truncated, damaged, other-version or other-device package raises an error saying which."""
    return _export_module().load(path, device=device, reduce_overhead=reduce_overhead)


def __getattr__(name):
    if name == "ember_backend":
        from .backend import ember_backend

        return ember_backend
    raise AttributeError(f"module 'ember' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)  # the public names: help(ember) and dir(ember) list these
