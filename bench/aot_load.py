"""A restarted process's first call, with and without Dynamo: torch.compile over a warm compile cache against
torch.compiler.load_compiled_function of an aot_compile artifact (ember/aot.py).

    python bench/aot_load.py                      # mlp and encoder, 3 fresh processes each way
    python bench/aot_load.py encoder --runs 5

For each model one process fills a fresh compile cache (a plain torch.compile first call) and saves the model's
aot_compile artifact; then, in turns, --runs fresh processes time "plain": torch.compile(model, backend="ember")
and its first call (Dynamo's tracing, a cache hit, the run), and "aot": load_compiled_function and the first call
(the module passed in). Each time runs from after `import torch`, the model's build and the imports of
torch._dynamo and ember's extension (timed apart: both ways pay them) to the first call's output; the medians
are printed. CPU, inference (no_grad). Models: mlp, 512-1024-1024-10 (ReLU) at batch 64 (as
harness.py's mlp_b64); encoder, nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024,
batch_first=True) on 8x128x256.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch


class Model(torch.nn.Module):
    """A module class of this file's around the model: the saved guards name its class, which the loading process
    imports; torch.nn's own modules, compiled as they are, are held by the saved function and need external_data."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def build(name):
    torch.manual_seed(0)
    if name == "mlp":
        layers = [torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                  torch.nn.Linear(1024, 10)]
        return Model(torch.nn.Sequential(*layers)).eval(), torch.randn(64, 512)
    layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
    return Model(layer).eval(), torch.randn(8, 128, 256)


def child(step, name, folder):
    model, x = build(name)
    artifact = os.path.join(folder, name + ".aot")
    start = time.perf_counter()
    import torch._dynamo  # noqa: F401  what both ways import first (in a program, maybe before its first call)

    import ember._C  # noqa: F401
    import ember.report

    imports = time.perf_counter() - start
    report = ember.report.ExplainReport()
    ember.report._active.append(report)
    with torch.no_grad():
        start = time.perf_counter()
        if step == "aot":
            with open(artifact, "rb") as f:
                out = torch.compiler.load_compiled_function(f)(model, x)
        else:
            out = torch.compile(model, backend="ember")(x)
        seconds = time.perf_counter() - start
        if step == "prepare":
            compiled = torch.compile(model, backend="ember", fullgraph=True).forward.aot_compile(((x,), {}))
            compiled.save_compiled_function(artifact)
        error = (out - model(x)).abs().max().item()
    assert step != "plain" or report.cache_hits == 1, "the warm run missed the compile cache"
    print(f"SECONDS {imports:.4f} {seconds:.4f} ERROR {error:.1e}")


def run(step, name, folder):
    """(seconds importing torch._dynamo and ember's extension, seconds of the step after them) of one process."""
    env = dict(os.environ, EMBER_CACHE_DIR=os.path.join(folder, "cache"))
    done = subprocess.run([sys.executable, __file__, "--child", step, name, folder], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{step} {name} failed:\n{done.stderr[-3000:]}")
    seconds, error = done.stdout.split("SECONDS ")[1].split(" ERROR ")
    assert float(error) < 1e-3, f"{step} {name}: max error {error}"
    imports, seconds = (float(t) for t in seconds.split())
    return imports, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", choices=[[], "mlp", "encoder"], help="default: both")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU threads")
    for name in args.models or ["mlp", "encoder"]:
        with tempfile.TemporaryDirectory(prefix="ember-aot-load-") as folder:
            _, cold = run("prepare", name, folder)
            times = {"plain": [], "aot": []}
            imports = []
            for _ in range(args.runs):
                for step in times:
                    seconds = run(step, name, folder)
                    imports.append(seconds[0])
                    times[step].append(seconds[1])
            plain, aot = (statistics.median(times[s]) for s in ("plain", "aot"))
            print(f"{name}: importing torch._dynamo and ember's extension {statistics.median(imports):.3f} s, then: "
                  f"cold torch.compile first call {cold:.3f} s; warm-cache torch.compile first call {plain:.3f} s "
                  f"{sorted(times['plain'])}; load_compiled_function + first call {aot:.3f} s {sorted(times['aot'])}")


if __name__ == "__main__":
    main()
