"""bench/harness.py, the project's benchmark, on one small workload: what it records per backend (no speed asserted)."""

import importlib.util
import math
import os

import pytest

HARNESS = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "harness.py")


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("ember_bench_harness", HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_harness_records_first_call_error_and_both_latencies(harness):
    backends = ["eager", harness.FLOOR, "ember"]
    result = harness.run_workload(harness.WORKLOADS["matmul_softmax"], "cpu", backends, repeat=5, warmup=1, block=2)
    rows = result["backends"]
    assert list(rows) == backends
    for backend in backends:
        row = rows[backend]
        assert "error" not in row, row
        assert row["first_call_s"] > 0
        # latency_ms in turns of `block` calls, latency_alternating_ms call by call: both medians of `repeat` calls
        assert row["latency_ms"] > 0 and row["latency_alternating_ms"] > 0
        assert math.isclose(row["speedup"], rows["eager"]["latency_ms"] / row["latency_ms"])
        eager_alternating = rows["eager"]["latency_alternating_ms"]
        assert math.isclose(row["speedup_alternating"], eager_alternating / row["latency_alternating_ms"])
    assert rows["ember"]["graphs"] == 1
    assert rows["ember"]["max_rel_error"] < 1e-5 and rows[harness.FLOOR]["max_rel_error"] == 0
    assert rows["ember"]["compiles_waited_s"] >= 0


def test_cold_first_calls_take_the_median_of_fresh_processes(harness):
    # --cold --cold-repeat 2 on one backend: two fresh processes, their first calls and Dynamo shares kept, the
    # medians reported; eager and a backend that failed get no fresh process.
    import argparse
    import statistics

    result = {"workload": "matmul_softmax", "backends": {"eager": {}, "ember": {}, "inductor": {"error": "x"}}}
    args = argparse.Namespace(device="cpu", threads=1, cold_repeat=2)
    harness.cold_first_calls(result, args)
    rows = result["backends"]
    assert rows["eager"] == {} and rows["inductor"] == {"error": "x"}
    samples = rows["ember"]["cold_first_call_samples"]
    assert len(samples) == 2 and all(s > 0 for s in samples)
    assert rows["ember"]["cold_first_call_s"] == statistics.median(samples)
    dynamo = rows["ember"]["cold_dynamo_samples"]
    assert len(dynamo) == 2 and all(0 < d < s for d, s in zip(dynamo, samples))
    assert rows["ember"]["cold_dynamo_s"] == statistics.median(dynamo)


def test_warm_first_calls_follow_each_cold_one_over_its_caches(harness):
    # --cold --warm: a second fresh process per cold one, over the caches that one filled.
    import argparse

    result = {"workload": "matmul_softmax", "backends": {"eager": {}, "ember": {}}}
    harness.cold_first_calls(result, argparse.Namespace(device="cpu", threads=1, cold_repeat=1, warm=True))
    row = result["backends"]["ember"]
    assert row["cold_first_call_s"] > 0 and row["warm_first_call_s"] > 0
    assert 0 < row["warm_dynamo_s"] < row["warm_first_call_s"]


def test_cold_over_picks_the_workloads_above_the_ratio(harness):
    # --cold-over 0.25: fresh processes only where ember's in-process first call took over a quarter of
    # inductor's, or where either is missing.
    def result(ember, inductor):
        rows = {"eager": {"first_call_s": 0.01}}
        if ember is not None:
            rows["ember"] = {"first_call_s": ember}
        if inductor is not None:
            rows["inductor"] = {"first_call_s": inductor}
        return {"workload": "w", "backends": rows}

    assert harness.cold_wanted(result(0.183, 0.354), 0.25)
    assert not harness.cold_wanted(result(0.071, 3.48), 0.25)
    assert harness.cold_wanted(result(0.071, 3.48), 0.0)
    assert harness.cold_wanted(result(0.071, None), 0.25)
    assert harness.cold_wanted(result(None, 3.48), 0.25)


def test_dynamic_bench_records_sizes_compiles_errors_and_the_serving_run():
    """bench/dynamic.py's run for one workload and backend: latencies per size (dynamic, and static compiles timed
    alternating with it in its process), the recompiles of automatic dynamic (the first size static, one symbolic
    recompile; the static compiles beside it add none to it), errors against eager."""
    spec = importlib.util.spec_from_file_location("ember_bench_dynamic", os.path.join(os.path.dirname(HARNESS), "dynamic.py"))
    dynamic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dynamic)
    r = {}
    for phase in dynamic.PHASES:
        r.update(dynamic.child("mlp", "ember", "default", phase, "cpu", serve=12, repeat=2))
    sizes = r["sizes"]
    for name in ("eager_s", "first_call_s", "dynamic_s", "static_s", "dynamic_alt_s", "static_first_call_s", "error",
                 "static_alone_s", "dynamic_alone_s"):
        assert len(r[name]) == len(sizes), name
    assert all(t > 0 for t in r["dynamic_s"] + r["static_s"] + r["dynamic_alt_s"] + r["eager_s"] + r["static_alone_s"])
    assert r["compiles"] == 2, r  # static at the first size, symbolic at the second, none after
    assert 1 <= r["serve_compiles"] <= 3 and r["serve_s"] > 0
    assert max(r["error"]) < 1e-4, r["error"]
    # --chart: bench/chart.py's schema, a row per size with the symbolic and the static bars
    chart = dynamic.to_chart([dict(r, workload="mlp", backend="ember", mode="default")], {"cpu_count": 2}, "cmd",
                             "2026-12-04", "suite")
    assert [row["workload"] for row in chart["rows"]] == [f"mlp {n}" for n in sizes]
    assert all(set(row["speedup"]) == {"ember", "ember static"} for row in chart["rows"]), chart["rows"][0]
