"""Grouped bar charts of benchmark results: one PNG per results file, one bar per backend for each workload.

    python bench/chart.py docs/data/cuda_default.json                 # writes docs/img/cuda_default.png
    python bench/chart.py docs/data/*.json --out-dir docs/img
    python bench/harness.py --json results.json && python bench/chart.py results.json

A results file (what docs/data/ holds and `bench/harness.py --json` writes) is one suite:

    {
      "suite": "CUDA default mode, whole suite",      # the chart's title
      "date": "2026-11-28",                           # when it was measured
      "machine": "NVIDIA H200",                       # where
      "torch": "2.11.0+cu130",                        # with which torch
      "command": "python bench/harness.py --device cuda --modes default --repeat 30",
      "metric": "speedup",                            # the key of each row's values; default "speedup"
      "label": "speedup over eager (higher is better)",   # y axis; optional
      "backends": ["eager", "ember", "inductor"],     # bar order; optional (default: as the rows name them)
      "rows": [
        {"workload": "MLP b64", "speedup": {"eager": 1.0, "ember": 1.36, "inductor": 0.69}},
        ...
      ],
      "note": "..."                                   # optional: anything the numbers need said
    }

matplotlib is imported only when a chart is drawn; without it chart.py says so and exits with status 2.
"""

import argparse
import json
import math
import os
import sys

REQUIRED = ("suite", "date", "machine", "torch", "command", "rows")
COLORS = {"eager": "#9e9e9e", "ember": "#d9480f", "inductor": "#1c7ed6", "ember-ro": "#f08c00",
          "inductor-ro": "#4dabf7", "ember static": "#ffa8a8", "ember-ro static": "#ffd8a8"}


def load(path):
    """The results file at `path`, checked against the schema above; raises ValueError naming what is wrong."""
    with open(path) as f:
        data = json.load(f)
    missing = [key for key in REQUIRED if key not in data]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}")
    metric = data.get("metric", "speedup")
    for i, row in enumerate(data["rows"]):
        if "workload" not in row or not isinstance(row.get(metric), dict):
            raise ValueError(f"{path}: row {i} needs 'workload' and a '{metric}' object of backend -> number")
    return data


def backends_of(data):
    metric = data.get("metric", "speedup")
    if data.get("backends"):
        return list(data["backends"])
    seen = []
    for row in data["rows"]:
        seen += [b for b in row[metric] if b not in seen]
    return seen


def geomean(values):
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def draw(data, path):
    """Writes the grouped bar chart of `data` (a loaded results file) to the PNG `path`."""
    try:
        import matplotlib
    except ImportError:
        print("bench/chart.py needs matplotlib (python3 -m pip install matplotlib); no chart written", file=sys.stderr)
        sys.exit(2)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = data.get("metric", "speedup")
    rows = data["rows"]
    backends = backends_of(data)
    width = 0.8 / len(backends)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.5 * len(rows) + 2.5), 5.0))
    for i, backend in enumerate(backends):
        xs = [j + (i - (len(backends) - 1) / 2) * width for j in range(len(rows))]
        ys = [row[metric].get(backend, 0.0) or 0.0 for row in rows]
        ax.bar(xs, ys, width, label=backend, color=COLORS.get(backend))
    if metric == "speedup":
        ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([row["workload"] for row in rows], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(data.get("label", "speedup over eager (higher is better)" if metric == "speedup" else metric))
    ax.set_title(f"{data['suite']}\n{data['machine']}, torch {data['torch']}, {data['date']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def from_harness(results, machine, command, date, suite, backends=("eager", "ember", "inductor", "ember-ro",
                                                                    "inductor-ro")):
    """A results file (the schema above) from bench/harness.py's in-memory results: each workload's speedup
    over eager per backend, for the backends that measured one."""
    rows = []
    for r in results:
        if "skipped" in r:
            continue
        speedups = {b: row["speedup"] for b, row in r.get("backends", {}).items() if "speedup" in row}
        if speedups:
            rows.append({"workload": r["workload"], "speedup": speedups})
    present = [b for b in backends if any(b in row["speedup"] for row in rows)]
    return {**header(machine, command, date, suite), "backends": present, "rows": rows}


def header(machine, command, date, suite):
    """A results file's fields other than its rows, from harness.machine_info()'s dict."""
    where = machine.get("gpu") or machine.get("cpu") or machine.get("device", "")
    return {"suite": suite, "date": date, "machine": f"{where} ({machine.get('cpu_count')} CPU cores)",
            "torch": machine.get("torch", ""), "command": command, "metric": "speedup"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", help="results JSON files (the schema in this file's docstring)")
    parser.add_argument("--out-dir", default=None,
                        help="where the PNGs go (default: docs/img for files under docs/data, else beside each file)")
    args = parser.parse_args(argv)
    for path in args.results:
        data = load(path)
        out_dir = args.out_dir
        if out_dir is None:
            here = os.path.dirname(os.path.abspath(path))
            out_dir = os.path.join(os.path.dirname(here), "img") if os.path.basename(here) == "data" else here
        png = os.path.join(out_dir, os.path.splitext(os.path.basename(path))[0] + ".png")
        draw(data, png)
        metric = data.get("metric", "speedup")
        means = {b: geomean([row[metric].get(b) for row in data["rows"]]) for b in backends_of(data)}
        print(f"wrote {png}  (geomean " + ", ".join(f"{b} {m:.2f}" for b, m in means.items() if m) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
