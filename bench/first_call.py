"""Where one workload's first call goes, in this fresh process with a fresh ember kernel cache.

    python bench/first_call.py bert_b8_s128 [cuda|cpu]
    python bench/first_call.py zoo:efficientnet_b0 [cuda|cpu]     # a bench/zoo.py model at zoo.py's default batch and seq

Splits the first call of `torch.compile(model, backend="ember")` on a bench/harness.py workload into: Dynamo's
tracing (call start to the backend's entry), ATen tracing (AOTAutograd or trace.py's one pass: the backend's
time minus ember's compile), ember's compile (lowering, passes, code generation, NVRTC), the first run of what
the backend returned, and the rest (Dynamo's guards and its tail); then when the kernels compiling in the background
(ember.wait_for_compiles) had all loaded. Prints that line and ember.explain's split of ember's compile (passes,
codegen, NVRTC summed over its threads, modules compiled).
KEEP_CACHE=1 keeps EMBER_CACHE_DIR and CUDA_CACHE_PATH as set (warm kernel caches). EAGER_FIRST=1 runs the model
eagerly once before (the device, its libraries and the model warmed, as harness.py --cold's processes do).
LATE_WARM_UP=1 starts NVRTC's warm-up at the backend's entry, as where ember.backend was imported before CUDA was in
use. PROFILE=<n> prints cProfile's
top n functions of the first call by own time and by cumulative time; PROFILE_DUMP=<file> also writes its stats there
(for pstats: print_callees and the like).
"""

import os
import sys
import tempfile
import time
import types

if not os.environ.get("KEEP_CACHE"):
    os.environ["EMBER_CACHE_DIR"] = tempfile.mkdtemp(prefix="ember-first-call-")
    # The CUDA driver's compute cache, where NVRTC also keeps what it compiled (see harness.CACHE_ENV).
    os.environ["CUDA_CACHE_PATH"] = tempfile.mkdtemp(prefix="ember-first-call-cuda-")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import ember.backend  # noqa: E402
import ember.report  # noqa: E402
import harness  # noqa: E402


def main():
    name = sys.argv[1]
    device = sys.argv[2] if len(sys.argv) > 2 else ("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("zoo:"):
        import zoo

        zoo_args = types.SimpleNamespace(batch=zoo.default_batch(device), seq=zoo.default_seq(device), dtype="f32")
        model, inputs = zoo.build(name[4:], device, zoo_args)
        training = False
    else:
        w = harness.WORKLOADS[name]
        model, inputs = w.build(device)
        training = w.training
    spent = {"enter": None, "backend": 0.0, "ember": 0.0, "first_run": 0.0, "graphs": 0}

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    compile_fx_graph = ember.backend.compile_fx_graph

    def timed_compile(*args, **kwargs):
        start = time.perf_counter()
        try:
            return compile_fx_graph(*args, **kwargs)
        finally:
            spent["ember"] += time.perf_counter() - start

    ember.backend.compile_fx_graph = timed_compile

    def backend(gm, example_inputs):
        if spent["enter"] is None:
            spent["enter"] = time.perf_counter() - t0
        spent["graphs"] += 1
        start = time.perf_counter()
        compiled = ember.backend.ember_backend(gm, example_inputs, options=harness.EMBER_OPTIONS)
        spent["backend"] += time.perf_counter() - start
        first = [True]

        def run(*args):
            if not first[0]:
                return compiled(*args)
            first[0] = False
            start = time.perf_counter()
            out = compiled(*args)
            sync()
            spent["first_run"] += time.perf_counter() - start
            return out

        if getattr(compiled, "_boxed_call", False):
            run._boxed_call = True
        return run

    report = ember.report.ExplainReport()
    ember.report._active.append(report)
    grad = torch.enable_grad if training else torch.no_grad
    if not os.environ.get("LATE_WARM_UP"):
        # torch.compile(backend="ember") imports ember.backend here, which starts NVRTC's warm-up where CUDA is
        # in use; this script imported it earlier, so it makes that call itself
        ember.backend._warm_up_if_cuda_in_use()
    with grad():
        if os.environ.get("EAGER_FIRST"):
            model(*inputs)
            sync()
        fn = torch.compile(model, backend=backend)
        profile = int(os.environ.get("PROFILE", "0"))
        if profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        t0 = time.perf_counter()
        fn(*inputs)
        sync()
        total = time.perf_counter() - t0
        if profile:
            profiler.disable()
        ember.wait_for_compiles()
        loaded = time.perf_counter() - t0
    ember.report._active.pop()
    report.total_s = spent["backend"]
    tracing = spent["backend"] - spent["ember"]
    rest = total - spent["enter"] - spent["backend"] - spent["first_run"]
    print(f"{name}: first call {total:.3f} s = Dynamo {spent['enter']:.3f} + ATen tracing {tracing:.3f} + ember's "
          f"compile {spent['ember']:.3f} + first run {spent['first_run']:.3f} + rest {rest:.3f} ({spent['graphs']} graph(s)); "
          f"every kernel loaded {loaded:.3f} s after the call's start")
    line = [x for x in str(report).splitlines() if x.startswith("compile time")]
    print("  ember's compile: " + (line[0][line[0].index("lowering"):] if line else str(report)))
    if profile:
        import pstats

        if os.environ.get("PROFILE_DUMP"):
            profiler.dump_stats(os.environ["PROFILE_DUMP"])
        for key in ("tottime", "cumulative"):
            pstats.Stats(profiler, stream=sys.stdout).sort_stats(key).print_stats(profile)


if __name__ == "__main__":
    main()
