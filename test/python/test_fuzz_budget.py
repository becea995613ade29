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


def test_float64_reference_promotes_bool_values_to_float64():
    """Fuzz seed 722035: atan2 of two bool tensors is float32 (the default dtype) and 1 ulp apart between
    elements (ATen's vector and scalar loops); layer_norm of that row divides the ulp by sqrt(eps) and sqrt
    magnifies it, so eager and ember gave 0 against 0.004. Only a reference that computes the promoted values
    in float64 too shows that float32 cannot resolve the program: it is counted as ill-conditioned."""
    import check

    prog = {"inputs": [{"dtype": "bool", "grad": False, "layout": "contig", "shape": [13, 2, 2], "special": False}],
            "ops": [{"args": ["i0"], "expr": "{0}.flatten()", "tag": "flatten"},
                    {"args": ["v0"], "expr": "torch.add({0}, True, alpha=2)", "tag": "add_alpha_s"},
                    {"args": ["v0"], "expr": "torch.amax({0}, dim=(0,), keepdim=True)", "tag": "amax"},
                    {"args": ["v2", "v1"], "expr": "torch.atan2({0}, {1})", "tag": "atan2"},
                    {"args": ["v3"], "expr": "F.layer_norm({0}, [52])", "tag": "layer_norm"},
                    {"args": ["v4"], "expr": "torch.sqrt({0}.abs())", "tag": "sqrt"}]}
    result = check.check_program(prog, "cpu")
    assert result["kind"] != "mismatch", result["detail"]
    assert torch.get_default_dtype() == torch.float32
