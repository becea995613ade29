"""Shrinks a failing program (delta debugging) and writes it as a standalone reproducer.

A candidate is kept when it still fails the same way (same kind; for errors the same exception type too).
Candidates, tried in this order until none is kept: drop an op (its readers read its first argument
instead), drop an unused input, then per input: no special values, a contiguous layout, no gradient,
float32, and each dim shrunk to 1 or to half its size. Candidates run in the fuzzer's worker pool, as
many at once as it has workers.
"""

import copy
import json
import os
import pprint
import re
import time

import program as prog_mod


def _rename(args, mapping):
    return [mapping.get(a, a) for a in args]


def drop_op(program, k):
    """The program without op k: its readers read its first argument instead (None where it has none)."""
    ops = program["ops"]
    if len(ops) < 2 or (not ops[k]["args"] and f"v{k}" in prog_mod.used_args(program)):
        return None
    mapping = {f"v{j}": f"v{j - 1}" for j in range(k + 1, len(ops))}
    if ops[k]["args"]:
        mapping[f"v{k}"] = ops[k]["args"][0]  # an earlier value: keeps its name
    new = copy.deepcopy(program)
    new["ops"] = ops[:k] + [dict(op, args=_rename(op["args"], mapping)) for op in ops[k + 1:]]
    return new


def drop_input(program, n):
    if f"i{n}" in prog_mod.used_args(program):
        return None
    new = copy.deepcopy(program)
    del new["inputs"][n]
    mapping = {f"i{m}": f"i{m - 1}" for m in range(n + 1, len(program["inputs"]))}
    new["ops"] = [dict(op, args=_rename(op["args"], mapping)) for op in new["ops"]]
    return new


def candidates(program):
    for k in reversed(range(len(program["ops"]))):
        yield drop_op(program, k)
    for n in reversed(range(len(program["inputs"]))):
        yield drop_input(program, n)
    for n, spec in enumerate(program["inputs"]):
        for key, value in (("special", False), ("layout", "contig"), ("grad", False), ("dtype", "float32")):
            if spec.get(key) != value and not (key == "dtype" and spec["dtype"] not in prog_mod.FLOATS):
                new = copy.deepcopy(program)
                new["inputs"][n][key] = value
                yield new
        for d, size in enumerate(spec["shape"]):
            for smaller in sorted({1, size // 2}):
                if smaller < size:
                    new = copy.deepcopy(program)
                    new["inputs"][n]["shape"][d] = smaller
                    yield new


def same_failure(a, b):
    if a["kind"] != b["kind"]:
        return False
    if a["kind"] == "error":
        return re.split(r"[:(]", a["detail"])[0:2] == re.split(r"[:(]", b["detail"])[0:2]
    return _mismatch_class(a["detail"]) == _mismatch_class(b["detail"])


def _mismatch_class(detail):
    """("output" / "input after the call" / "grad of input", what differs), of a mismatch's detail."""
    where = re.search(r"(output|input after the call|grad of input)", detail)
    what = re.search(r"(NaN at|Inf at|max error|dtype|shape|device|elements differ|outputs, expected|None)", detail)
    return (where and where.group(1), what and what.group(1))


def shrink(pool, program, result, budget_s=180, log=print):
    """(smallest program found, its result)."""
    if result["kind"] == "hang":
        return program, result  # each try would cost a timeout
    start = time.time()
    width = len(pool.slots)
    progress = True
    while progress and time.time() - start < budget_s:
        progress = False
        batch = []
        for cand in candidates(program):
            if cand is None:
                continue
            batch.append(cand)
            if len(batch) < width:
                continue
            kept = _try(pool, batch, result)
            batch = []
            if kept:
                program, result = kept
                progress = True
                break
            if time.time() - start > budget_s:
                break
        else:
            if batch:
                kept = _try(pool, batch, result)
                if kept:
                    program, result = kept
                    progress = True
    log(f"  shrunk to {len(program['ops'])} ops, {len(program['inputs'])} inputs in {time.time() - start:.0f} s")
    return program, result


def _try(pool, batch, result):
    results = {}
    for (_, cand), res in pool.run([("program", c) for c in batch]):
        results[id(cand)] = (cand, res)
    for cand in batch:
        c, res = results.get(id(cand), (None, None))
        if res is None:
            continue
        if same_failure(result, res):
            return res.get("program", c), res
    return None


def write_repro(out, seed, result, program, device, mode):
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{result['kind']}_{seed}.py")
    detail = result["detail"].replace('"""', "'''")
    header = (f'"""Reproducer found by test/fuzz/graph_fuzz.py (seed {seed}, --device {device} --mode {mode}).\n\n'
              f"{result['kind']}: {detail[:1500]}\n\"\"\"\n\n")
    meta = (f"KIND = {result['kind']!r}\nSEED = {seed}\nDEVICE = {device!r}\nMODE = {mode!r}\n"
            f"# KNOWN_OPEN = \"why it still fails\"  (set it while the bug is open: the test then xfails strictly)\n"
            f"PROGRAM = {pprint.pformat(program, width=110)}\n")
    source = prog_mod.render(program)
    with open(path, "w") as f:
        f.write(header + source.replace("import torch.nn.functional as F\n", "import torch.nn.functional as F\n\n" + meta, 1))
    json.dumps(program)  # the program stays plain data
    return path


def known_open(program, result, folder):
    """The name of the KNOWN_OPEN reproducer in folder whose SIGNATURE this shrunk failure has, or None."""
    import glob
    import importlib.util

    tags = {op["tag"] for op in program["ops"]}
    empty = any(0 in spec["shape"] for spec in program["inputs"])
    for path in sorted(glob.glob(os.path.join(folder, "*.py"))):
        spec = importlib.util.spec_from_file_location("fuzz_known_" + os.path.basename(path)[:-3], path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sig = getattr(module, "SIGNATURE", None)
        if not getattr(module, "KNOWN_OPEN", None) or not sig or getattr(module, "KIND", None) != result["kind"]:
            continue
        if not set(sig["tags"]) <= tags or (sig.get("empty_input") and not empty):
            continue
        if sig.get("differs") and sig["differs"] not in result["detail"]:
            continue
        return os.path.basename(path)
    return None
