"""NVRTC's time for ember's CUDA modules: inside a process that ran ember, and alone in a fresh one.

    python bench/nvrtc_time.py entropy                 # a bench/harness.py workload, compiled by ember on CUDA
    python bench/nvrtc_time.py --sources a.cu b.cu     # given sources (no GPU needed)

On the H100 host (session 18) ember reported 0.71 s of NVRTC wall time for the entropy scorer's two modules,
while NVRTC compiled the same module source in 17 ms in a process of its own (its third compile). This
separates the candidates: NVRTC's first compile in a process (initialization, libdevice), the process
around it (threads, allocator, what torch loaded), and the host's own speed.

For a workload, ember compiles it once with EMBER_DEBUG set (fresh EMBER_CACHE_DIR) and its modules are read back
from the dump's kernels.txt: each group's whole module text, which ember compiles as two modules (the
general entry beside the others), so the times here are of one module per group. Each source is then
compiled --reps times in this process (through the libnvrtc ember loaded) and in a fresh Python process that
imports nothing else. Prints ms per compile, first and later ones apart.
"""

import argparse
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


def time_compiles(library, sources, arch, reps):
    """[[ms per compile] per source]; -1 where NVRTC failed."""
    lib = ctypes.CDLL(library)
    options = (ctypes.c_char_p * 2)(f"--gpu-architecture={arch}".encode(), b"--std=c++17")
    out = []
    for text in sources:
        times = []
        for _ in range(reps):
            program = ctypes.c_void_p()
            lib.nvrtcCreateProgram(ctypes.byref(program), text.encode(), b"k.cu", 0, None, None)
            start = time.perf_counter()
            failed = lib.nvrtcCompileProgram(program, 2, options)
            times.append(-1.0 if failed else (time.perf_counter() - start) * 1e3)
            lib.nvrtcDestroyProgram(ctypes.byref(program))
        out.append(times)
    return out


def ember_modules(name):
    """(module sources, ember's explain line) of workload `name` compiled by ember on CUDA."""
    folder = tempfile.mkdtemp(prefix="ember-nvrtc-time-")
    os.environ["EMBER_DEBUG"] = folder
    os.environ["EMBER_CACHE_DIR"] = tempfile.mkdtemp(prefix="ember-nvrtc-cache-")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch

    import ember.report
    import harness

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
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"library": library, "sources": sources, "arch": arch, "reps": args.reps}, f)
    env = dict(os.environ)  # NVRTC finds its builtins library next to itself through the loader's path
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (os.path.dirname(library), env.get("LD_LIBRARY_PATH")) if p)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", f.name], capture_output=True, text=True,
                          env=env)
    os.unlink(f.name)
    alone = json.loads(done.stdout) if done.returncode == 0 else None
    if alone is None:
        print(f"the fresh process failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
    for line in explain:
        if "nvrtc" in line or "codegen" in line:
            print("ember:", line.strip())
    print(f"NVRTC {library}, {arch}; ms per compile, {args.reps} in a row")
    print(f"{'module':<8}{'lines':>7}   {'in this process':<28}{'in a fresh process':<28}")
    for i, text in enumerate(sources):
        fmt = lambda ts: " ".join(f"{t:7.1f}" for t in ts)  # noqa: E731
        print(f"{i:<8}{text.count(chr(10)):>7}   {fmt(here[i]):<28}{fmt(alone[i]) if alone else '-':<28}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
