"""What `import ember` adds to `import torch`, measured in fresh interpreters.

    python bench/import_time.py               # 10 runs of each, interleaved
    python bench/import_time.py --repeat 20

Two kinds of subprocess, run alternately:
    torch          times `import torch`
    torch+ember    times `import torch`, then `import ember` on its own
The report gives the medians, the difference of the two medians, the median of the time `import ember`
took inside the second kind of run, and the modules `import ember` loaded. The target is ember adding
<= 50 ms; the verdict uses the in-process figure, since the difference of medians of two sets of ~1 s
imports carries their noise. Exits with status 1 when ember adds more than --target-ms.
"""

import argparse
import json
import statistics
import subprocess
import sys

TORCH_ONLY = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
print(json.dumps({"torch_s": t1 - t0}))
"""

TORCH_AND_EMBER = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
before = set(sys.modules)
import ember
t2 = time.perf_counter()
added = sorted(set(sys.modules) - before)
print(json.dumps({"torch_s": t1 - t0, "ember_s": t2 - t1, "total_s": t2 - t0, "added": added}))
"""


def run(code):
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=10, help="runs of each kind")
    parser.add_argument("--target-ms", type=float, default=50.0)
    args = parser.parse_args(argv)

    run(TORCH_AND_EMBER)  # warm the file system cache, untimed
    torch_only, with_ember, ember_alone = [], [], []
    added = []
    for _ in range(args.repeat):
        torch_only.append(run(TORCH_ONLY)["torch_s"] * 1e3)
        r = run(TORCH_AND_EMBER)
        with_ember.append(r["total_s"] * 1e3)
        ember_alone.append(r["ember_s"] * 1e3)
        added = r["added"]

    med_torch = statistics.median(torch_only)
    med_both = statistics.median(with_ember)
    delta = med_both - med_torch
    inside = statistics.median(ember_alone)
    def spread(values):
        return f"(min {min(values):.1f}, max {max(values):.1f}, n={len(values)})"

    print(f"import torch               median {med_torch:8.1f} ms  {spread(torch_only)}")
    print(f"import torch; import ember median {med_both:8.1f} ms  {spread(with_ember)}")
    print(f"difference of medians             {delta:8.1f} ms")
    print(f"import ember alone (after torch)  {inside:8.1f} ms  median {spread(ember_alone)}")
    print(f"modules import ember loaded ({len(added)}): {', '.join(added)}")
    # The verdict uses the in-process figure: the difference of medians of two ~1 s imports carries their noise.
    verdict = "PASS" if inside <= args.target_ms else "FAIL"
    print(f"{verdict}: import ember adds {inside:.1f} ms (difference of medians {delta:+.1f} ms); "
          f"target <= {args.target_ms:.0f} ms")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
