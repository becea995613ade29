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
