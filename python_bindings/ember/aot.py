"""ember.aot: what torch.compile(..., backend="ember", fullgraph=True).aot_compile(...) saves and loads.

    compiled = torch.compile(model, backend="ember", fullgraph=True).forward.aot_compile(((x,), {}))
    compiled.save_compiled_function("model.aot")
    ...                                                   # another process, same torch, ember and Python
    with open("model.aot", "rb") as f:
        compiled = torch.compiler.load_compiled_function(f)
    out = compiled(model, x)                              # the live module's parameters, Dynamo's guards

torch's aot_compile (torch/_dynamo/aot_compile.py) runs Dynamo once, ahead of time, and asks the backend for a
torch._dynamo.aot_compile_types.SerializableCallable; saving pickles Dynamo's bytecode, guards and that
callable's bytes, and loading rebuilds them without tracing anything. ember_backend sees that it runs there
(backend._compiling_ahead_of_time) and returns an AOTCompiledGraph: the DirectCall it compiled, and the compile
cache's entry it was built from (cache.py: the IR text of each graph, its constants, which inputs keep their
address, the facts the C++ training call needs). Loading builds the DirectCall from that entry as a compile
cache hit does (backend.entry_call): the C++ pipeline runs on the stored IR, nothing is traced, and CUDA
kernels come from the kernel cache where it holds them.

Parameters and buffers are inputs of the graph Dynamo captures (torch reads them from the module passed at
each call), so the loaded function computes with the live module's values. Graphs the compile cache does not
store (AOTAutograd's Python wrapper kept, control flow; ember.config.direct_call off) cannot be saved:
aot_compile raises EmberError saying so. A graph that only takes views, or one ember could not compile and runs
eagerly (fallback="warn"), is saved as torch's own serializable FX graph.

The artifact must be loaded by the ember build that saved it (the same files: cache._versions) and torch
checks its own version, Python's and the device type; settings that change a trace are part of the saved IR,
while ember's C++ settings (gemm_route, cpu_matmul, ...) are this process's, with a warning where they differ.
Bytes that are not such an artifact raise EmberError.
"""

import hashlib
import io
import warnings

from .errors import EmberError

try:  # imported inside aot_compile or when torch loads an artifact: Dynamo is loaded by then
    from torch._dynamo.aot_compile_types import SerializableCallable as _SerializableCallable
except ImportError:  # a torch without aot_compile
    _SerializableCallable = object

FORMAT = 1
_KIND = "ember-aot"
# Tried on torch 2.13 (CPU). On torch 2.11 (CUDA 13.0, the H100 host) every test of test_aot_compile.py failed,
# with AttributeError among the errors: refused there with a clear error rather than kept broken.
MIN_TORCH = (2, 13)


def _torch_version():
    import torch

    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def compile_for_aot(gm, example_inputs, config):
    """ember_backend inside aot_compile: what it compiled, wrapped so that torch can save it."""
    from . import backend

    if _SerializableCallable is object:  # a torch without aot_compile: nothing will ask to save it
        return backend._compile_graph(gm, example_inputs, config)
    import torch
    import torch._functorch.config

    if _torch_version() < MIN_TORCH:
        raise EmberError(f"aot_compile with ember needs torch {MIN_TORCH[0]}.{MIN_TORCH[1]} or later (this is torch "
                         f"{torch.__version__}); torch.compile(..., backend=\"ember\") without aot_compile works here")

    built = {}
    # aot_compile also asks AOTAutograd for its own bundled cache entry, which it builds from Inductor's output
    # code only (an ember graph fails its check): ember saves its own entry instead, so not for this compile.
    with torch._functorch.config.patch(force_autograd_cache=False, bundled_autograd_cache=False):
        compiled = backend._compile_graph(gm, example_inputs, config, built)
    if built.get("graphs"):
        return AOTCompiledGraph(compiled, _artifact(built, config, gm, example_inputs))
    if compiled == gm.forward:  # only views, or fell back: Dynamo's graph runs as it is, and torch saves that
        from torch._dynamo.aot_compile_types import GraphModuleSerializableCallable

        return GraphModuleSerializableCallable(gm)
    from . import config as ember_config

    why = ("ember.config.direct_call is off" if not ember_config.direct_call else
           "it keeps AOTAutograd's Python wrapper (an output aliasing an input, an input resized or restrided in "
           "place, tensor subclasses, ...) or has control flow (torch.cond, while_loop)")
    raise EmberError(f"ember cannot save this graph for aot_compile: {why}. torch.compile(..., backend=\"ember\") "
                     "without aot_compile runs it.")


def _artifact(built, config, gm, example_inputs):
    from . import backend, cache

    entry = {k: v for k, v in built.items() if k not in ("format", "key")}
    return {
        "format": FORMAT,
        "kind": _KIND,
        "versions": cache._versions(),
        "entry": entry,
        "options": dict(vars(config)),
        "inputs": len(example_inputs),
        "shapes_guarded": backend._shapes_guarded(gm, example_inputs),
        "settings": _settings(),
    }


def _settings():
    """The C++ settings in effect that change what the C++ pipeline builds from the IR (routes, kernels): those
    a load applies anew. The rest change the trace, which the saved IR holds already; cuda_background changes
    only when a kernel is ready, and cache._NOT_IN_KEY's where things are cached and with how many threads."""
    from . import cache, config

    return sorted((name, repr(value)) for name, value in config._current().items()
                  if config.SETTINGS[name].cpp and name not in cache._NOT_IN_KEY and name != "cuda_background")


# An artifact's bytes: this header, the SHA-256 of the rest, then torch.save of the artifact dict. torch.load
# checks no checksum of its own: a flipped byte in an IR string or a constant would load as another graph.
_HEADER = b"ember-aot\0"


def serialize(artifact):
    import torch

    from .cache import _outside_tracing

    out = io.BytesIO()
    with _outside_tracing():
        torch.save(artifact, out)
    payload = out.getvalue()
    return _HEADER + hashlib.sha256(payload).digest() + payload


def deserialize(data):
    """The DirectCall an artifact's bytes describe, built without tracing; EmberError for bytes that are not an
    ember aot_compile artifact, or one of another ember build."""
    artifact = _read(data)
    from . import backend, cache

    if artifact["versions"] != cache._versions():
        raise EmberError("ember: this aot_compile artifact was saved by another ember build or torch "
                         f"({artifact['versions']}; this process: {cache._versions()}); run aot_compile again "
                         "with this one")
    here = dict(_settings())
    differ = [f"{name}={value} (here {here.get(name)})" for name, value in artifact["settings"]
              if here.get(name) != value]
    if differ:
        warnings.warn("ember: this aot_compile artifact was compiled under other ember settings: "
                      f"{', '.join(differ)}; its traced IR keeps them, the C++ pipeline runs with this process's",
                      stacklevel=3)
    config = backend.CompileConfig.__new__(backend.CompileConfig)
    config.__dict__.update(artifact["options"])
    try:
        direct = backend.entry_call(artifact["entry"], config, lambda first: first.num_inputs == artifact["inputs"],
                                    artifact["shapes_guarded"])
    except Exception as e:
        raise EmberError(f"ember: this aot_compile artifact does not compile ({type(e).__name__}: {e})") from None
    if direct is None:
        raise EmberError(f"ember: this aot_compile artifact's graph does not take the {artifact['inputs']} inputs "
                         "its Dynamo graph passes")
    return direct, artifact


def _read(data):
    """The artifact dict in `data`, checked field by field; EmberError for anything else."""
    import torch

    from .cache import _outside_tracing

    try:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"{type(data).__name__}, not bytes")
        data = bytes(data)
        if not data.startswith(_HEADER):
            raise ValueError("no ember-aot header")
        digest, payload = data[len(_HEADER):len(_HEADER) + 32], data[len(_HEADER) + 32:]
        if hashlib.sha256(payload).digest() != digest:
            raise ValueError("its checksum does not match its contents (truncated or damaged)")
        with _outside_tracing():
            artifact = torch.load(io.BytesIO(payload), weights_only=True)
        if not isinstance(artifact, dict) or artifact.get("kind") != _KIND:
            raise ValueError("not an ember aot_compile artifact")
        if artifact.get("format") != FORMAT:
            raise ValueError(f"format {artifact.get('format')!r}, this ember reads {FORMAT}")
        for name, kind in (("versions", str), ("entry", dict), ("options", dict), ("inputs", int),
                           ("shapes_guarded", bool), ("settings", list)):
            if not isinstance(artifact.get(name), kind):
                raise ValueError(f"no {name}")
        entry = artifact["entry"]
        count = {"inference": 1, "training": 2}.get(entry.get("kind"))
        if count is None or not isinstance(entry.get("graphs"), list) or len(entry["graphs"]) != count:
            raise ValueError("no graphs")
        if not isinstance(entry.get("pinned"), list) or (entry["kind"] == "training" and not isinstance(
                entry.get("spec"), dict)):
            raise ValueError("an incomplete entry")
        for graph in entry["graphs"]:
            if not isinstance(graph, dict) or not isinstance(graph.get("ir"), str) or not isinstance(
                    graph.get("constants"), dict) or not isinstance(graph.get("pinned"), list):
                raise ValueError("a graph without its IR")
            if any(type(t) is not torch.Tensor or t.is_meta for t in graph["constants"].values()):
                raise ValueError("a constant without its values")
    except Exception as e:
        raise EmberError(f"ember: not an ember aot_compile artifact ({type(e).__name__}: {e})") from None
    return artifact


class AOTCompiledGraph(_SerializableCallable):
    """An ember DirectCall that torch's aot_compile can save (serialize_compile_artifacts) and load
    (deserialize_compile_artifacts: built from the stored IR, nothing traced)."""

    def __init__(self, fn, artifact):
        self.fn = fn
        self.artifact = artifact

    @classmethod
    def serialize_compile_artifacts(cls, fn):
        return serialize(fn.artifact)

    @classmethod
    def deserialize_compile_artifacts(cls, data):
        return cls(*deserialize(data))

    def __call__(self, *args):
        return self.fn(*args)
