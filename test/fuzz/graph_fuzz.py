"""Differential graph fuzzer: random torch programs, eager against torch.compile(backend="ember").

    python3 test/fuzz/graph_fuzz.py --count 300 --seed 0 --device cpu --mode default --workers 2 --out DIR

Program i has seed S + i (program.py generates it, check.py compares eager and ember). Each case runs in a
worker process (multiprocessing, spawn): a worker that dies is a crash (segfault, abort) and is replaced,
one that takes longer than --timeout seconds is a hang and is killed and replaced. Failures (mismatch,
crash, hang, error) are shrunk (shrink.py) and written as standalone reproducers to
DIR/<kind>_<seed>.py (test/fuzz/repros by default), which test/python/test_fuzz_repros.py runs. Graphs
ember refuses (an EmberError, so they run eagerly with a warning) are no failure; they are counted as
refusals, with their messages. A failure that backend="aot_eager" shows too is torch's (Dynamo or
AOTAutograd), not ember's, and so is a NaN of eager's float32 kernel where its float64 one agrees with
ember (check.py): counted as "upstream", no failure. A shrunk failure with the SIGNATURE of a
repro marked KNOWN_OPEN is that open bug: counted, no new repro. Exits 1 on any other failure.
"""

import argparse
import collections
import multiprocessing as mp
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FAILURES = ("mismatch", "crash", "hang", "error")


def _worker_main(conn, device, mode):
    sys.path.insert(0, HERE)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    import check
    import program as prog_mod

    while True:
        task = conn.recv()
        if task is None:
            return
        what, payload = task
        if what == "seed":
            program = prog_mod.generate(payload)
        else:
            program = payload
        result = check.check_program(program, device, mode)
        if result["kind"] == "invalid" and what == "seed" and any(s.get("grad") for s in program["inputs"]):
            # Usually an in-place op on a value autograd saved: the same program without gradients.
            for spec in program["inputs"]:
                spec["grad"] = False
            result = check.check_program(program, device, mode)
        result["program"] = program
        conn.send(result)


class Pool:
    """Worker processes that run one case at a time each; crashed and hung ones are replaced."""

    def __init__(self, workers, device, mode, timeout):
        self.device, self.mode, self.timeout = device, mode, timeout
        self.ctx = mp.get_context("spawn")
        self.slots = [self._start() for _ in range(workers)]

    def _start(self):
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_worker_main, args=(child, self.device, self.mode), daemon=True)
        proc.start()
        child.close()
        return {"proc": proc, "conn": parent, "task": None, "since": 0.0}

    def run(self, tasks, deadline=None):
        """Yields (task, result) for each task (what, payload); the order is the order of completion. After
        time.time() passes deadline, no new task starts: those running finish, the rest are left out."""
        pending = collections.deque(tasks)
        while pending or any(s["task"] is not None for s in self.slots):
            if deadline is not None and time.time() > deadline:
                pending.clear()
            for slot in self.slots:
                if slot["task"] is None and pending:
                    slot["task"], slot["since"] = pending.popleft(), time.time()
                    slot["conn"].send(slot["task"])
            busy = [s for s in self.slots if s["task"] is not None]
            if not busy:
                continue
            ready = mp.connection.wait([s["conn"] for s in busy] + [s["proc"].sentinel for s in busy], timeout=1.0)
            for i, slot in enumerate(self.slots):
                if slot["task"] is None:
                    continue
                task = slot["task"]
                result = None
                if slot["conn"] in ready:
                    try:
                        result = slot["conn"].recv()
                    except (EOFError, OSError):
                        result = None
                if result is None and (slot["proc"].sentinel in ready or not slot["proc"].is_alive()):
                    slot["proc"].join(1)
                    result = {"kind": "crash", "detail": f"worker died with exit code {slot['proc'].exitcode}",
                              "refused": []}
                    self.slots[i] = self._start()
                elif result is None and time.time() - slot["since"] > self.timeout:
                    slot["proc"].kill()
                    slot["proc"].join(5)
                    result = {"kind": "hang", "detail": f"no result after {self.timeout} s", "refused": []}
                    self.slots[i] = self._start()
                if result is not None:
                    self.slots[i]["task"] = None
                    yield task, result

    def close(self):
        for slot in self.slots:
            try:
                slot["conn"].send(None)
            except OSError:
                pass
        for slot in self.slots:
            slot["proc"].join(5)
            if slot["proc"].is_alive():
                slot["proc"].kill()


def fuzz(count, seed, device, mode, workers, out, timeout=60, shrink_failures=True, log=print, time_budget=None,
         progress_every=0, shrink_budget=None):
    """Runs count programs (fewer if time_budget seconds pass first: counts["run"] says how many ran, and
    shrinking comes after the budget); returns (counts, new failures, refusals). A failure whose shrunk program
    has the SIGNATURE of a KNOWN_OPEN reproducer in test/fuzz/repros is counted as "known", not as a new
    failure. progress_every=N logs the counts after every N programs; shrink_budget caps the seconds spent
    shrinking all failures (each gets at most 180 s)."""
    sys.path.insert(0, HERE)
    import program as prog_mod
    import shrink

    counts = collections.Counter()
    refusals = collections.Counter()
    failures = []
    new_failures = []  # the failures that are no KNOWN_OPEN reproducer's bug
    pool = Pool(workers, device, mode, timeout)
    start = time.time()
    deadline = start + time_budget if time_budget else None
    try:
        for (_, s), result in pool.run([("seed", seed + i) for i in range(count)], deadline):
            kind = result["kind"]
            counts[kind] += 1
            counts["run"] += 1
            if progress_every and counts["run"] % progress_every == 0:
                log(f"progress: {counts['run']} programs in {time.time() - start:.0f} s: "
                    + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()) if k != "run"))
            for message in result.get("refused", []):
                refusals[message.split("\n")[0][:160]] += 1
            if kind == "upstream":
                log(f"seed {s}: upstream (torch's, not ember's): {result['detail'][:300]}")
            if kind in FAILURES:
                log(f"seed {s}: {kind}: {result['detail'][:500]}")
                failures.append((s, result))
        shrink_spent = 0.0
        for s, result in failures:
            program = result.get("program") or prog_mod.generate(s)
            if shrink_failures:
                left = 180 if shrink_budget is None else min(180, shrink_budget - shrink_spent)
                t0 = time.time()
                program, result = shrink.shrink(pool, program, result, budget_s=max(left, 0), log=log)
                shrink_spent += time.time() - t0
            known = shrink.known_open(program, result, os.path.join(HERE, "repros")) if shrink_failures else None
            if known:
                counts["known"] += 1
                log(f"seed {s}: {result['kind']}: the open bug of repros/{known} ({len(program['ops'])} ops shrunk)")
                continue
            path = shrink.write_repro(out, s, result, program, device, mode)
            log(f"seed {s}: {result['kind']} ({len(program['ops'])} ops after shrinking) -> {path}")
            new_failures.append((s, result))
    finally:
        pool.close()
    return counts, new_failures, refusals


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--mode", choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
                    default="default", help="torch.compile's mode for ember (the max-autotune ones tune at first calls)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case before it counts as a hang")
    ap.add_argument("--out", default=os.path.join(HERE, "repros"), help="folder for the reproducer files")
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds after which no new program starts (those running finish, then failures shrink)")
    ap.add_argument("--shrink-budget", type=float, default=None, help="seconds for shrinking all failures")
    ap.add_argument("--progress", type=int, default=0, metavar="N", help="print the counts after every N programs")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("fuzz: --device cuda asked for, but this machine has no CUDA device; nothing run")
            return 0
    elif args.mode in ("reduce-overhead", "max-autotune"):
        print(f"fuzz: note: {args.mode} captures CUDA graphs; on CPU it checks repeated calls only")
    start = time.time()
    counts, failures, refusals = fuzz(args.count, args.seed, args.device, args.mode, args.workers, args.out,
                                      args.timeout, not args.no_shrink, time_budget=args.time_budget,
                                      progress_every=args.progress, shrink_budget=args.shrink_budget)
    for message, n in refusals.most_common(15):
        print(f"  refused {n}x: {message}")
    print(f"fuzz: {counts['run']} programs (seeds {args.seed}-{args.seed + counts['run'] - 1} of the {args.count} asked; "
          f"the last ones may be left out by --time-budget), {counts['mismatch']} mismatches, {counts['crash']} crashes, "
          f"{counts['hang']} hangs, {counts['error']} errors, {counts['refusal']} refusals "
          f"({counts['known']} failures are open bugs with a repro, {counts['upstream']} torch's own, "
          f"{counts['invalid']} rejected by eager, "
          f"{time.time() - start:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
