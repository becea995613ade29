"""The torch.compile entry point: torch.compile(model, backend="ember", mode=..., options=...).

Dynamo hands ember a torch-level FX graph; AOTAutograd (with ember's decomposition table) turns it into
forward / backward / inference graphs of ATen ops; each of those is lowered to IR text, compiled in
C++ and handed back as a C++ callable (boxed calling convention, no Python per call).

Options (torch.compile's `options=` dict) and the environment variables that set the same thing:

    fallback        "warn" (default): a graph ember cannot compile runs eagerly, with one warning
                    "raise": raise ember.EmberError naming the node            EMBER_FALLBACK
    disable_passes  pass names to skip, a list or a comma-separated string     EMBER_DISABLE_PASSES
    debug_dir       write the FX graph, the IR after each pass and the plan    EMBER_DEBUG
"""

import itertools
import os
import time
import warnings

from .errors import EmberError

MODES = (None, "default", "reduce-overhead")
OPTIONS = ("fallback", "disable_passes", "debug_dir")
FALLBACKS = ("warn", "raise")

_graph_ids = itertools.count()
_warned_reduce_overhead = False


class CompileConfig:
    """The resolved mode, options and environment for one torch.compile call."""

    def __init__(self, mode=None, options=None):
        if mode not in MODES:
            raise EmberError(f"unknown mode {mode!r}; ember accepts: {', '.join(repr(m) for m in MODES)}")
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise EmberError(f"unknown option(s) {', '.join(map(repr, unknown))}; ember accepts: {', '.join(OPTIONS)}")
        self.mode = mode or "default"
        self.fallback = options.get("fallback", os.environ.get("EMBER_FALLBACK", "warn"))
        if self.fallback not in FALLBACKS:
            raise EmberError(f"fallback must be one of {FALLBACKS}, not {self.fallback!r}")
        passes = options.get("disable_passes", os.environ.get("EMBER_DISABLE_PASSES", ""))
        if isinstance(passes, str):
            passes = [p.strip() for p in passes.split(",") if p.strip()]
        self.disabled_passes = list(passes)
        self.debug_dir = options.get("debug_dir", os.environ.get("EMBER_DEBUG", "")) or ""

    def check_passes(self, known):
        unknown = [p for p in self.disabled_passes if p not in known]
        if unknown:
            raise EmberError(f"unknown pass(es) {unknown} in disable_passes; ember's passes: {', '.join(known)}")


def _hint_nvrtc():
    """Points ember at the NVRTC that torch's CUDA wheels install, unless EMBER_NVRTC_PATH is set."""
    if os.environ.get("EMBER_NVRTC_PATH"):
        return
    import glob

    import torch

    root = os.path.join(os.path.dirname(torch.__file__), "..", "nvidia")
    found = sorted(glob.glob(os.path.join(root, "**", "libnvrtc.so*"), recursive=True))
    if found:
        os.environ["EMBER_NVRTC_PATH"] = os.path.realpath(found[-1])


def compile_fx_graph(gm, config, kind):
    """Lowers and compiles one AOTAutograd graph; returns a boxed callable."""
    from functorch.compile import make_boxed_func

    graph_name = f"g{next(_graph_ids)}_{kind}"
    from . import report

    try:
        from . import _C
        from .lower import lower

        if config.debug_dir:
            os.makedirs(config.debug_dir, exist_ok=True)
            with open(os.path.join(config.debug_dir, graph_name + ".fx.py"), "w") as f:
                f.write(gm.print_readable(print_output=False))
        if any(n.op == "placeholder" and getattr(n.meta.get("val"), "is_cuda", False) for n in gm.graph.nodes):
            _hint_nvrtc()
        start = time.perf_counter()
        ir, constants = lower(gm)
        lower_ms = (time.perf_counter() - start) * 1e3
        compiled = _C.compile(ir, constants, config.disabled_passes, config.debug_dir, graph_name)
        compiled._boxed_call = True
        report.record_graph(graph_name, kind, gm, compiled, lower_ms, ir)
        return compiled
    except Exception as e:
        report.record_fallback(kind, str(e))
        if config.fallback == "raise":
            if isinstance(e, EmberError):
                raise
            raise EmberError(f"ember could not compile the {kind} graph: {e}") from e
        warnings.warn(f"ember could not compile the {kind} graph and runs it eagerly: {e}", stacklevel=2)
        return make_boxed_func(gm.forward)


def ember_backend(gm, example_inputs, mode=None, options=None):
    """The backend torch.compile calls (registered as "ember" through the package's entry point)."""
    global _warned_reduce_overhead
    config = CompileConfig(mode, options)
    if config.disabled_passes:  # a configuration error raises whatever the fallback setting
        from . import _C

        config.check_passes(_C.pass_names())
    if config.mode == "reduce-overhead" and not _warned_reduce_overhead:
        _warned_reduce_overhead = True
        warnings.warn("ember: mode='reduce-overhead' does not capture CUDA graphs yet; running the default plan")

    from torch._dynamo.backends.common import aot_autograd

    from .decompositions import decomposition_table

    def compiler(kind):
        return lambda g, inputs: compile_fx_graph(g, config, kind)

    backend = aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        decompositions=decomposition_table(),
        keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs)
