"""ember.explain(fn)(*args) (this module is ember.report): what ember compiled for one call, and where the compile time went.

    report = ember.explain(model)(x)
    print(report)

The report lists each graph ember compiled (forward / backward / inference), its plan (fused kernels,
oneDNN matmuls with the epilogue fused into them, and the ATen ops that run one by one), the CUDA GEMMs whose
choice was timed (each candidate's time and the winner; mode="max-autotune" times them all), the symbolic sizes
padded to buckets (pad_to_buckets: what each pads and slices, the calls run at each size) or why a graph was not,
the sizes that hold CUDA graphs in reduce-overhead mode, the graphs that fell back to eager and why, and the compile
time split into Dynamo and ATen tracing (AOTAutograd, trace.py's one pass or joint.py's call-by-call training
trace), lowering to IR, ember's passes, code generation and plan building.
"""

import collections
import time

import torch

_active = []  # stack of ExplainReport being filled


class GraphReport:
    def __init__(self, name, kind, fx_nodes, steps, timings, lower_ms, ir, compiled=None, graphs_note="", unpadded=""):
        self.compiled = compiled
        self.graphs_note = graphs_note  # why CUDA graphs were not installed, when they were asked for
        self.unpadded = unpadded  # why pad_to_buckets left the graph at its own sizes (backend._size_buckets)
        self.name = name
        self.kind = kind
        self.fx_nodes = fx_nodes
        self.steps = steps  # [(kind, what)]
        self.timings = dict(timings)  # pass / codegen / plan -> ms
        self.lower_ms = lower_ms
        self.ir = ir

    @property
    def cuda_graphs(self):
        """What the CUDA graph runner captures and has done ('' without one)."""
        if self.compiled is not None and self.compiled.cuda_graphs:
            return self.compiled.cuda_graph_report()
        return ""

    @property
    def padded(self):
        """pad_to_buckets: per padded symbol, what it pads and slices and the calls run at each size (read when
        asked, so the counts are those of every call so far); [] where nothing is padded."""
        if self.compiled is None or not hasattr(self.compiled, "size_buckets"):
            return []
        return list(self.compiled.size_buckets())

    @property
    def tuned(self):
        """What the graph's steps timed to choose, one line per problem (the CUDA GEMMs: kernels/cuda/gemm.cpp; under
        max-autotune fused CUDA kernels' launches: kernels/cuda/launch_tuning.h, and fused CPU kernels' threads per
        call shape: kernels/cpu/thread_tuning.h), read when asked: the choices are made at a step's first call, after
        the compile."""
        if self.compiled is None or not hasattr(self.compiled, "tuning"):
            return []
        return list(self.compiled.tuning())

    @property
    def kernels(self):
        """Fused kernels ember generated (oneDNN calls are listed apart, in `onednn`)."""
        return [what for kind, what in self.steps
                if kind == "kernel" and not what.startswith("onednn") and what != "fold_batchnorm"]

    @property
    def folded_batchnorms(self):
        """Eval batch norms folded into the weights and bias of the convolution before them."""
        return sum(1 for kind, what in self.steps if kind == "kernel" and what == "fold_batchnorm")

    @property
    def onednn(self):
        """oneDNN primitives with their fused epilogues: "matmul f32 +bias relu"."""
        return [what[len("onednn "):] for kind, what in self.steps if kind == "kernel" and what.startswith("onednn")]

    @property
    def aten_ops(self):
        return collections.Counter(what for kind, what in self.steps if kind == "aten")

    @property
    def control_flow(self):
        """torch.cond / while_loop / scan steps, each running subgraphs compiled as graphs of their own."""
        return [what for kind, what in self.steps if kind == "control"]


class ExplainReport:
    def __init__(self):
        self.graphs = []
        self.fallbacks = []  # (kind, reason)
        self.as_is = []  # what graphs with nothing to compile did (views, detach): they run as Dynamo traced them
        self.masks = [0, 0]  # attention masks read at compile time: dropped, made is_causal (attention.py)
        self.flex = []  # per flex_attention call: None (ember's CUDA kernel) or why it runs dense (flex.py)
        self.attention = []  # max-autotune's attention kernel choices, a line each (attention_tuning.py)
        self.cache_hits = 0  # Dynamo graphs whose compile came from the compile cache (cache.py)
        self.total_s = 0.0
        self.backend_s = 0.0  # inside ember's compilers

    def __str__(self):
        subgraphs = sum(1 for g in self.graphs if g.kind == "subgraph")
        lines = [f"ember.explain: {len(self.graphs) - subgraphs} graph(s) compiled"
                 + (f" (and {subgraphs} control flow subgraph(s))" if subgraphs else "")
                 + f", {len(self.fallbacks)} fell back to eager"]
        for g in self.graphs:
            aten = g.aten_ops
            onednn = f"{len(g.onednn)} oneDNN call(s), " if g.onednn else ""
            control = f"{len(g.control_flow)} control flow step(s), " if g.control_flow else ""
            lines.append(f"- {g.name}: {g.fx_nodes} FX nodes -> {len(g.steps)} steps: {len(g.kernels)} fused kernel(s), "
                         f"{control}{onednn}{sum(aten.values())} ATen call(s)")
            for k in g.control_flow:
                lines.append(f"    control {k}")
            for k in g.kernels:
                lines.append(f"    kernel  {k}")
            for k in g.onednn:
                lines.append(f"    oneDNN  {k}")
            if g.folded_batchnorms:
                lines.append(f"    folded  {g.folded_batchnorms} batch norm(s) into convolution weights")
            if aten:
                lines.append("    ATen    " + ", ".join(f"{op} x{n}" if n > 1 else op for op, n in aten.most_common()))
            for line in g.tuned:
                lines.append(f"    tuned   {line}")
            for line in g.padded:
                lines.append(f"    padded  {line}")
            if g.unpadded:
                lines.append(f"    not padded: {g.unpadded}")
            if g.cuda_graphs:
                lines.extend("    " + line for line in g.cuda_graphs.rstrip().splitlines())
            elif g.graphs_note:
                lines.append(f"    no CUDA graphs: {g.graphs_note}")
        if self.cache_hits:
            lines.append(f"- {self.cache_hits} Dynamo graph(s) from the compile cache: no tracing or lowering")
        for kind, reason in self.fallbacks:
            lines.append(f"- {kind} graph ran eagerly: {reason}")
        for what in self.as_is:
            lines.append(f"- a graph with nothing to compile ({what}) runs as Dynamo traced it")
        if any(self.masks):
            lines.append(f"- attention masks computed from constants: {self.masks[0]} dropped (they mask nothing), "
                         f"{self.masks[1]} replaced by is_causal")
        if self.flex:
            dense = [why for why in self.flex if why is not None]
            lines.append(f"- flex_attention: {len(self.flex) - len(dense)} call(s) as ember's CUDA kernel, "
                         f"{len(dense)} as dense ATen ops" + (f" ({'; '.join(sorted(set(dense)))})" if dense else ""))
        for line in self.attention:
            lines.append(f"- tuned {line}")
        passes = collections.defaultdict(float)
        lower = 0.0
        for g in self.graphs:
            lower += g.lower_ms
            for k, v in g.timings.items():
                passes[k] += v
        ember_ms = lower + sum(v for k, v in passes.items() if ":" not in k)  # "codegen: nvrtc" is within codegen
        trace_ms = max(self.total_s * 1e3 - ember_ms, 0.0)
        lines.append(f"compile time: {self.total_s * 1e3:.1f} ms in all = Dynamo + ATen tracing {trace_ms:.1f} ms, "
                     f"lowering {lower:.1f} ms, " + ", ".join(_timing(k, v) for k, v in passes.items()))
        return "\n".join(lines)

    __repr__ = __str__


_COUNTS = ("codegen: modules compiled", "codegen: modules from disk", "codegen: modules in background",
           "codegen: nvrtc major faults", "codegen: nvrtc minor faults", "codegen: nvrtc preemptions")


def _timing(name, value):
    # a few entries are counts (compiler.cpp); every other one is milliseconds
    return f"{name} {int(value)}" if name in _COUNTS else f"{name} {value:.1f} ms"


def record_graph(name, kind, fx_nodes, compiled, lower_ms, ir, graphs_note="", unpadded=""):
    if _active:
        _active[-1].graphs.append(
            GraphReport(name, kind, fx_nodes, compiled.steps(), compiled.timings, lower_ms, ir, compiled, graphs_note,
                        unpadded)
        )


def record_cache(hit):
    if _active:
        _active[-1].cache_hits += 1 if hit else 0


def record_as_is(what):
    if _active:
        _active[-1].as_is.append(what)


def record_masks(dropped, causal):
    if _active:
        _active[-1].masks[0] += dropped
        _active[-1].masks[1] += causal


def record_flex(why):
    if _active:
        _active[-1].flex.append(why)


def record_attention(line):
    if _active:
        _active[-1].attention.append(line)


def record_fallback(kind, reason):
    if _active:
        _active[-1].fallbacks.append((kind, reason))


def explain(fn, *, mode=None, options=None, dynamic=None):
    """Returns a function that compiles `fn` with ember afresh, calls it once and returns the report."""

    def run(*args, **kwargs):
        report = ExplainReport()
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="ember", mode=mode, options=options, dynamic=dynamic)
        _active.append(report)
        start = time.perf_counter()
        try:
            compiled(*args, **kwargs)
        finally:
            report.total_s = time.perf_counter() - start
            _active.pop()
            torch._dynamo.reset()
        return report

    return run

