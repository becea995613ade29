"""Runs every reproducer the graph fuzzer wrote (test/fuzz/repros/*.py) and asserts ember matches eager.

Each file defines program(...), make_inputs(device, seed=0), KIND, DEVICE, MODE and PROGRAM (the fuzzer's
data structure). A repro of a bug still open sets KNOWN_OPEN = "reason": the test then xfails strictly, so
a fix makes it fail until the marker is removed. A crash or hang repro runs in a process of its own, so
that it cannot take the test run down with it.
"""

import glob
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

FUZZ = os.path.join(os.path.dirname(__file__), "..", "fuzz")
sys.path.insert(0, FUZZ)

import check  # noqa: E402

REPROS = sorted(glob.glob(os.path.join(FUZZ, "repros", "*.py")))


def _load(path):
    spec = importlib.util.spec_from_file_location("fuzz_repro_" + os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _params():
    out = []
    for path in REPROS:
        module = _load(path)
        marks = []
        if getattr(module, "DEVICE", "cpu") == "cuda":
            marks.append(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))
        if getattr(module, "KNOWN_OPEN", None):
            marks.append(pytest.mark.xfail(strict=True, reason=module.KNOWN_OPEN))
        out.append(pytest.param(path, marks=marks, id=os.path.basename(path)[:-3]))
    return out


@pytest.mark.filterwarnings("ignore:ember could not compile")
@pytest.mark.parametrize("path", _params())
def test_fuzz_repro(path):
    module = _load(path)
    if module.KIND in ("crash", "hang"):
        _check_in_a_process(path)
        return
    result = check.check_program(module.PROGRAM, module.DEVICE, module.MODE)
    assert result["kind"] in ("ok", "refusal"), f"{result['kind']}: {result['detail']}"
    # The rendered functions in the file are the program itself (what a reader runs by hand).
    fn_result = check.check(module.program, module.make_inputs, module.DEVICE, module.MODE,
                            grad=any(s.get("grad") for s in module.PROGRAM["inputs"]), loose=True)
    assert fn_result["kind"] in ("ok", "refusal"), f"{fn_result['kind']}: {fn_result['detail']}"


def _check_in_a_process(path, timeout=300):
    script = ("import importlib.util, sys; sys.path.insert(0, sys.argv[2]); import check; "
              "spec = importlib.util.spec_from_file_location('repro', sys.argv[1]); "
              "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
              "r = check.check_program(m.PROGRAM, m.DEVICE, m.MODE); print(r['kind'], r['detail'][:2000])")
    try:
        done = subprocess.run([sys.executable, "-c", script, path, FUZZ], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hang: no result after {timeout} s")
    assert done.returncode == 0, f"crash: exit code {done.returncode}: {done.stderr[-1500:]}"
    kind = done.stdout.strip().split("\n")[-1].split(" ")[0] if done.stdout.strip() else ""
    assert kind in ("ok", "refusal"), done.stdout[-2000:]
