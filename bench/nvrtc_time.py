"""NVRTC's time for ember's CUDA modules: inside a process that ran ember, and alone in a fresh one.

    python bench/nvrtc_time.py entropy                 # a bench/harness.py workload, compiled by ember on CUDA
    python bench/nvrtc_time.py --sources a.cu b.cu     # given sources (no GPU needed)

On an H100 host ember once reported 0.71 s of NVRTC wall time for the entropy scorer's two modules,
while NVRTC compiled the same module source in 17 ms in a process of its own (its third compile). This
separates the candidates: NVRTC's first compile in a process (initialization, libdevice), the process
around it (threads, allocator, what torch loaded), and the host's own speed.

For a workload, ember compiles it once with ember.config.debug_dir set (a fresh cache_dir) and its modules are
read back from the dump's kernels.txt: each group's whole module text, which ember compiles as two modules (the
general entry beside the others), so the times here are of one module per group. Each source is then
compiled --reps times in this process (through the libnvrtc ember loaded) and in a fresh Python process that
imports nothing else (and, for a workload, in one that initialized torch's CUDA first), first one after the
other, then all at once on a thread each (as ember compiles distinct groups). Prints ms per compile, first and
later ones apart.

What it found (H100): 17-27 ms per compile in every column, so neither the process nor parallel
compiles explained those 0.71 s; those came from each fresh machine's first NVRTC process (explain's
"nvrtc cpu" and "nvrtc minor faults" show it: CPU-bound, ten times the page faults of later processes).
Why, found later: NVRTC keeps what it compiles in the CUDA driver's compute cache (CUDA_CACHE_PATH, default
~/.nv/ComputeCache), so a source compiled once on a machine compiles several times faster in every later process,
and the compiles here (sources ember had just compiled) were of that kind. Set CUDA_CACHE_PATH to a fresh folder
(or CUDA_CACHE_DISABLE=1) to time a first compile.
"""

import argparse
import concurrent.futures
import ctypes
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ARCH_DEFAULT = "sm_90"


def nvrtc_library():
    """The libnvrtc this process has loaded (ember's, after a CUDA compile), else the first one found."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "libnvrtc.so" in path and "builtins" not in path:
                    return path
    except OSError:
        pass
    hint = os.environ.get("EMBER_NVRTC_PATH")
    if hint:
        return hint
    for root in sys.path:
        found = glob.glob(os.path.join(root, "nvidia", "cu1*", "lib", "libnvrtc.so.1*"))
        if found:
            return sorted(found)[0]
    return "libnvrtc.so.13"


def compile_once(lib, text, options):
    """ms of one NVRTC compile of `text`; -1 where it failed. ctypes drops the GIL, so threads overlap."""
    program = ctypes.c_void_p()
    lib.nvrtcCreateProgram(ctypes.byref(program), text.encode(), b"k.cu", 0, None, None)
    start = time.perf_counter()
    failed = lib.nvrtcCompileProgram(program, 2, options)
    ms = -1.0 if failed else (time.perf_counter() - start) * 1e3
    lib.nvrtcDestroyProgram(ctypes.byref(program))
    return ms


def time_compiles(library, sources, arch, reps):
    """{"serial": [[ms per compile] per source], "parallel": [[ms] per source]}: each source `reps` times in a
    row, then all sources at once on a thread each (as ember compiles distinct groups), `reps` rounds."""
    lib = ctypes.CDLL(library)
    options = (ctypes.c_char_p * 2)(f"--gpu-architecture={arch}".encode(), b"--std=c++17")
    serial = [[compile_once(lib, text, options) for _ in range(reps)] for text in sources]
    parallel = [[] for _ in sources]
    for _ in range(reps):
        with concurrent.futures.ThreadPoolExecutor(max(1, len(sources))) as pool:
            for i, ms in enumerate(pool.map(lambda t: compile_once(lib, t, options), sources)):
                parallel[i].append(ms)
    return {"serial": serial, "parallel": parallel}


def ember_modules(name):
    """(module sources, ember's explain line) of workload `name` compiled by ember on CUDA."""
    folder = tempfile.mkdtemp(prefix="ember-nvrtc-time-")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch

    import ember.report
    import harness

    ember.config.debug_dir = folder
    ember.config.cache_dir = tempfile.mkdtemp(prefix="ember-nvrtc-cache-")

    w = harness.WORKLOADS[name]
    model, inputs = w.build("cuda")
    report = ember.report.ExplainReport()
    ember.report._active.append(report)
    with (torch.enable_grad() if w.training else torch.no_grad()):
        torch.compile(model, backend="ember", options=harness.EMBER_OPTIONS)(*inputs)
    torch.cuda.synchronize()
    ember.report._active.remove(report)
    sources = []
    for path in sorted(glob.glob(os.path.join(folder, "*kernels.txt"))):
        sources += [t for t in re.split(r"^// group \d+\n", open(path).read(), flags=re.M)[1:] if "__global__" in t]
    return sources, str(report).strip().splitlines()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workload", nargs="?", help="a bench/harness.py workload (compiled by ember on CUDA)")
    parser.add_argument("--sources", nargs="*", default=[], help=".cu files to time instead")
    parser.add_argument("--arch", default=None, help=f"NVRTC target (default: the device's, else {ARCH_DEFAULT})")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON job of the fresh process
    args = parser.parse_args(argv)
    if args.child:
        job = json.load(open(args.child))
        if job["torch"]:  # a process like the one ember runs in, before anything compiles
            import torch

            torch.zeros(1, device="cuda")
        print(json.dumps(time_compiles(job["library"], job["sources"], job["arch"], job["reps"])))
        return 0
    if not args.workload and not args.sources:
        parser.error("give a workload or --sources")
    explain = []
    if args.workload:
        sources, explain = ember_modules(args.workload)
    else:
        sources = [open(p).read() for p in args.sources]
    arch = args.arch
    if arch is None and args.workload:
        import torch

        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}"
    arch = arch or ARCH_DEFAULT
    library = nvrtc_library()
    here = time_compiles(library, sources, arch, args.reps)
    env = dict(os.environ)  # NVRTC finds its builtins library next to itself through the loader's path
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (os.path.dirname(library), env.get("LD_LIBRARY_PATH")) if p)

    def fresh(with_torch):
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"library": library, "sources": sources, "arch": arch, "reps": args.reps, "torch": with_torch}, f)
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", f.name], capture_output=True,
                              text=True, env=env)
        os.unlink(f.name)
        if done.returncode != 0:
            print(f"the fresh process failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return None
        return json.loads(done.stdout)

    columns = [("in this process", here), ("in a fresh process", fresh(False))]
    if args.workload:
        columns.append(("fresh, torch + CUDA", fresh(True)))
    for line in explain:
        if "nvrtc" in line or "codegen" in line:
            print("ember:", line.strip())
    fmt = lambda ts: " ".join(f"{t:7.1f}" for t in ts)  # noqa: E731
    for mode, what in (("serial", f"{args.reps} in a row"), ("parallel", f"all modules at once, {args.reps} rounds")):
        print(f"NVRTC {library}, {arch}; ms per compile, {what}")
        print(f"{'module':<8}{'lines':>7}   " + "".join(f"{title:<28}" for title, _ in columns))
        for i, text in enumerate(sources):
            cells = "".join(f"{fmt(times[mode][i]) if times else '-':<28}" for _, times in columns)
            print(f"{i:<8}{text.count(chr(10)):>7}   {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
