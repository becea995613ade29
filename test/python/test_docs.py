"""The front door stays usable: every relative link in README.md, CHANGELOG.md and docs/*.md resolves (anchors
included), the README stays a guide (at most 300 lines, none over 200 characters outside code blocks), and no
tracked file carries internal work-period labels."""

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# Link targets written in a change of their own, in parallel with the one that links them; drop an entry once
# that file is in the tree.
PENDING = set()
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
WORK_PERIOD = re.compile(r"session[s]? ?-?[0-9]|\bs[0-9]{2}\b/|\.carry/s[0-9]", re.IGNORECASE)


def markdown_files():
    files = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "CHANGELOG.md")]
    docs = os.path.join(ROOT, "docs")
    files += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    return files


def outside_code(text):
    """(line number, line) of the lines outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def anchors(path):
    """GitHub's anchors for the headings of a markdown file."""
    with open(path) as f:
        text = f.read()
    found = set()
    for _, line in outside_code(text):
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(path):
    with open(path) as f:
        text = f.read()
    broken = []
    for number, line in outside_code(text):
        for match in LINK.finditer(line):
            target = match.group(1) or match.group(2)
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            relative = os.path.relpath(resolved, ROOT)
            if relative.startswith(".."):
                broken.append(f"line {number}: {target} points outside the repository")
            elif not os.path.exists(resolved):
                if relative not in PENDING:
                    broken.append(f"line {number}: {target} does not exist")
            elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                broken.append(f"line {number}: {target}: no heading makes the anchor #{anchor}")
    assert not broken, "\n".join(broken)


def test_readme_is_a_guide():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    lines = text.split("\n")
    assert len(lines) <= 301, f"README.md has {len(lines)} lines; at most 300"  # 301: the final newline's split
    long = [f"line {n}: {len(line)} chars" for n, line in outside_code(text) if len(line) > 200]
    assert not long, "README.md lines over 200 chars outside code blocks:\n" + "\n".join(long)


def tracked_files():
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")) and not os.path.isfile(
            os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout: no list of tracked files")
    result = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if result.returncode != 0:
        pytest.skip("git ls-files failed: " + result.stderr.decode(errors="replace").strip())
    return [p for p in result.stdout.decode().split("\0") if p]


def test_no_work_period_labels():
    hits = []
    for relative in tracked_files():
        path = os.path.join(ROOT, relative)
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        if b"\0" in data[:4096]:  # binary (the charts)
            continue
        for number, line in enumerate(data.decode(errors="replace").split("\n"), 1):
            if WORK_PERIOD.search(line):
                hits.append(f"{relative}:{number}: {line.strip()[:120]}")
    assert not hits, "internal work-period labels in tracked files:\n" + "\n".join(hits)


def _chart_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ember_bench_chart", os.path.join(ROOT, "bench", "chart.py"))
    chart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chart)
    return chart


def test_benchmark_data_follow_the_schema_and_have_charts():
    chart = _chart_module()
    data_dir = os.path.join(ROOT, "docs", "data")
    names = sorted(f for f in os.listdir(data_dir) if f.endswith(".json"))
    assert names
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        benchmarks = f.read()
    for name in names:
        data = chart.load(os.path.join(data_dir, name))  # raises on a file that breaks the schema
        assert data["rows"], name
        png = "img/" + name[:-len(".json")] + ".png"
        assert os.path.isfile(os.path.join(ROOT, "docs", png)), png
        assert png in benchmarks, f"docs/benchmarks.md does not show {png}"


def test_harness_results_convert_to_the_chart_schema(tmp_path):
    chart = _chart_module()
    results = [{"workload": "mlp_b1", "backends": {"eager": {"speedup": 1.0}, "ember": {"speedup": 1.5},
                                                   "inductor": {"error": "failed"}}},
               {"workload": "bert_b8_s128", "skipped": "needs transformers"}]
    machine = {"torch": "2.13.0+cpu", "cpu": "some CPU", "cpu_count": 2, "device": "cpu"}
    data = chart.from_harness(results, machine, "python bench/harness.py --only mlp_b1", "2026-12-02", "test suite")
    assert data["backends"] == ["eager", "ember"]
    assert data["rows"] == [{"workload": "mlp_b1", "speedup": {"eager": 1.0, "ember": 1.5}}]
    path = tmp_path / "r.json"
    import json

    path.write_text(json.dumps(data))
    assert chart.load(str(path))["suite"] == "test suite"
    pytest.importorskip("matplotlib")
    assert os.path.getsize(chart.draw(data, str(tmp_path / "r.png"))) > 0
