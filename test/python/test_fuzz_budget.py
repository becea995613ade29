"""A fixed-seed budget of the graph fuzzer (test/fuzz/graph_fuzz.py): random programs, eager against ember.

Runs in two worker processes; a failure's shrunk reproducer lands in a temporary folder, named in the
assertion message (copy it to test/fuzz/repros/ to keep it). A failure that shrinks to the SIGNATURE of a
KNOWN_OPEN reproducer is that open bug (its repro xfails in test_fuzz_repros.py) and does not fail this
test. EMBER_FUZZ_COUNT changes the budget.
"""

import os
import sys

import pytest
import torch

FUZZ = os.path.join(os.path.dirname(__file__), "..", "fuzz")
sys.path.insert(0, FUZZ)

import graph_fuzz  # noqa: E402

COUNT = int(os.environ.get("EMBER_FUZZ_COUNT", "600"))


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_fuzz_budget(device, tmp_path):
    lines = []
    counts, failures, refusals = graph_fuzz.fuzz(COUNT, 20240, device, "default", 2, str(tmp_path),
                                                 timeout=120, log=lines.append)
    assert not failures, f"{len(failures)} fuzz failures (repros in {tmp_path}):\n" + "\n".join(lines)
    assert counts["ok"] + counts["refusal"] > COUNT // 2, counts  # most programs really ran through ember


def _off_by_a_little(gm, example_inputs):
    """A deliberately wrong backend: every floating output of the graph is 0.1% too large."""
    def run(*args):
        out = gm(*args)
        return type(out)(o * 1.001 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out)

    return run


def test_fuzz_checker_finds_a_wrong_backend():
    import check
    import program

    found = 0
    for seed in range(20):
        prog = program.generate(seed, training=False)
        fn, make_inputs = program.load(prog)
        if check.check(fn, make_inputs, backend="eager")["kind"] != "ok":
            continue  # the checker must pass a correct backend...
        if check.check(fn, make_inputs, backend=_off_by_a_little)["kind"] == "mismatch":
            found += 1  # ... and catch the wrong one
    assert found >= 10
