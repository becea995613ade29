"""ember.cache: whole compiles on disk, so that a restarted process skips ATen tracing and lowering.

    ember.cache.clear()                  # every entry gone
    ember.cache.entries()                # [(path, bytes)] of what the cache holds
    blob = ember.save_cache_artifacts()  # this cache and the CUDA kernel cache beside it, as bytes
    ember.load_cache_artifacts(blob)     # ... installed into another process's or machine's cache

A graph Dynamo hands ember is stored, once compiled into a C++ DirectCall, as what came out of lowering: the
IR text of each graph (inference; or forward and backward), the constants it reads, which inputs keep their
address, the inputs whose version counters a call bumps and the facts the C++ training call needs. That holds
for graphs trace.py (inference) or joint.py (training) traced and for those AOTAutograd traced (inputs or
buffers written in place, a batch norm's running statistics). A later compile of the same graph with the same
inputs and settings, in this process or another, reads the entry instead of tracing: the C++ pipeline
(passes, code generation, plan) runs on the stored IR, and CUDA kernels come from the kernel cache beside it,
as for a package (ember.load). Graphs with symbolic sizes are stored too (inference graphs; symbolic training
graphs keep AOTAutograd's wrapper), unless their compile added a guard on a size. Not stored: graphs that keep
AOTAutograd's Python wrapper (outputs aliasing inputs), graphs with control flow, and graphs whose inputs are
not plain tensors.

The key (`key`) hashes the Dynamo graph's code; each input's dtype, sizes, strides, storage offset, device,
requires_grad, leaf-ness and which inputs share memory (symbolic sizes by their expression, with the ShapeEnv's
guards, replacements and ranges: not the sizes of the call that compiled them); the mode, the compile's options and every ember setting
but `fallback` and those of caching and threads (`_NOT_IN_KEY`); the torch, CUDA and ember versions (a hash of
ember's installed files) and each GPU's name and compute capability; and the global
state that changes a trace or its kernels: grad mode, autocast, the default dtype, deterministic algorithms,
TF32 and reduced-precision matmul flags, the float32 matmul precision, the enabled attention kernels and
whether compiled autograd is on.

An entry that is unreadable, truncated, of another format or of another key, whose contents no longer match the
checksum stored with them, or whose fields disagree with each other or with its IR (`_check`) is a miss (logged at
debug level on the "ember" logger), never an error. Entries are written to a temporary file and renamed into
place, so that processes writing one key at once leave one whole entry. The folder is `<cache_dir>/graphs`
(`ember.config.cache_dir`: empty, ~/.cache/ember; "off": no cache); `ember.config.compile_cache = False` turns
this cache off; past `ember.config.compile_cache_mb` the least recently used entries go.

Artifacts (`save_artifacts`, `load_artifacts`; `ember.save_cache_artifacts` / `ember.load_cache_artifacts`)
carry the entries and the compiled CUDA kernels to another machine, so that a CI job can prewarm a fleet. An
entry is used there only where its key matches: the same torch, CUDA and ember build (the same files), the same
GPU model, and the same graphs, inputs, settings and global state. What does not match is a miss.
"""

import contextlib
import functools
import hashlib
import logging
import os
import re
import tempfile

from . import config

FORMAT = 1
_log = logging.getLogger("ember")


def _root():
    """The disk caches' folder (the CUDA kernels, and graphs/ for this one), or None where they are off."""
    root = config.cache_dir
    if root in ("off", "0"):
        return None
    return root or os.path.join(os.path.expanduser("~"), ".cache", "ember")


def folder():
    """The cache's folder, or None where it is off."""
    root = _root()
    if root is None or not config.compile_cache:
        return None
    return os.path.join(root, "graphs")


def entries():
    """[(path, size in bytes)] of the entries, least recently used first."""
    where = folder()
    if where is None or not os.path.isdir(where):
        return []
    found = []
    for name in os.listdir(where):
        if name.endswith(".entry"):
            path = os.path.join(where, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            found.append((st.st_mtime_ns, path, st.st_size))
    return [(path, size) for _, path, size in sorted(found)]


def holds_entries():
    """True when the folder holds at least one entry: a restarted process is then likely to hit."""
    where = folder()
    if where is None:
        return False
    try:
        with os.scandir(where) as it:
            return any(e.name.endswith(".entry") for e in it)
    except OSError:  # no folder yet
        return False


def clear():
    """Removes every entry; returns how many."""
    gone = 0
    for path, _ in entries():
        try:
            os.remove(path)
            gone += 1
        except OSError:
            pass
    return gone


@functools.lru_cache(maxsize=1)
def _versions():
    """torch's and CUDA's versions and a hash of ember's files (its Python files, the extension and the
    libember it loads): a rebuilt or edited ember is another ember, and one installed from the same build on
    another machine the same (hashing them takes a few milliseconds, once per process)."""
    import torch

    here = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for name in sorted(os.listdir(here)):
        if name.endswith((".py", ".so")):
            with open(os.path.join(here, name), "rb") as f:
                digest.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return repr((FORMAT, torch.__version__, torch.version.cuda, digest.hexdigest()))


def _global_state(devices):
    import torch
    import torch._dynamo.config

    state = [torch.is_grad_enabled(), str(torch.get_default_dtype()), torch.are_deterministic_algorithms_enabled(),
             torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
             torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction]
    for kind in ("cpu", "cuda"):
        state.append((kind, torch.is_autocast_enabled(kind), str(torch.get_autocast_dtype(kind))))
    state.append(bool(torch._dynamo.config.compiled_autograd))  # retraces backwards: no C++ training call then
    for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled"):
        probe = getattr(torch.backends.cuda, name, None)
        state.append(probe() if probe else None)
    for d in sorted(devices):
        if d.startswith("cuda"):
            index = torch.device(d).index or 0
            state.append((d, torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)))
    return state


# Settings that change neither a trace nor what is built from it: what a failed compile does, and where, whether
# and with how many threads things are cached and compiled (artifacts move between cache folders).
_NOT_IN_KEY = {"fallback", "cache_dir", "compile_cache", "compile_cache_mb", "compile_threads", "nvrtc_path"}


def key(gm, example_inputs, compile_config):
    """The hex key of one compile, or None where it is not cached (the cache is off, a debug directory is
    asked for, an input is not a tensor with plain sizes, the graph module holds tensors or submodules)."""
    import torch

    if folder() is None or config.debug_dir or getattr(compile_config, "debug_dir", ""):
        return None
    if next(gm.parameters(), None) is not None or next(gm.buffers(), None) is not None:
        return None
    if any(n.op in ("get_attr", "call_module") for n in gm.graph.nodes):
        return None
    inputs, storages, devices, symbols = [], {}, set(), set()

    def dims(values):  # sizes and strides: integers, or symbolic ones by their expression ("s0", "64*s0")
        out = []
        for v in values:
            if isinstance(v, torch.SymInt) and not v.node.is_nested_int():
                symbols.update(v.node.expr.free_symbols)
                out.append(str(v.node.expr))
            elif isinstance(v, int):
                out.append(v)
            else:
                raise TypeError(type(v))
        return tuple(out)

    traced = _traced_values(gm, example_inputs)
    try:
        for x, v in zip(example_inputs, traced):
            if isinstance(v, torch.SymInt):  # a size Dynamo passes the graph
                inputs.append(("size", dims([v])))
                continue
            if not isinstance(x, torch.Tensor) or x.layout != torch.strided or x.is_nested or type(x) not in (
                    torch.Tensor, torch.nn.Parameter):
                return None
            storage = storages.setdefault(x.untyped_storage().data_ptr(), len(storages))
            devices.add(str(x.device))
            v = v if isinstance(v, torch.Tensor) else x
            inputs.append((str(x.dtype), dims(v.shape), dims(v.stride()), dims([v.storage_offset()]), str(x.device),
                           x.requires_grad, x.is_leaf, type(x) is torch.nn.Parameter, storage))
    except TypeError:  # a float or nested size, a SymBool: not cached
        return None
    if symbols:
        state = shape_state(gm, example_inputs)
        if state is None:
            return None
        inputs.append(state)
    settings = sorted((name, repr(value)) for name, value in config._current().items() if name not in _NOT_IN_KEY)
    # The mode and options; not `fallback`, which decides only what a failed compile does (a stored one did not fail).
    options = sorted((name, repr(value)) for name, value in vars(compile_config).items() if name != "fallback")
    text = repr((_versions(), options, settings, _global_state(devices), inputs, gm.code))
    return hashlib.sha256(text.encode()).hexdigest()


def _traced_values(gm, example_inputs):
    """The graph's inputs as Dynamo traced them (its fake values: symbolic sizes where they vary), else the
    example inputs themselves (which Dynamo passes with the sizes of this call)."""
    values = [n.meta.get("example_value", n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder"]
    if len(values) != len(example_inputs):
        return list(example_inputs)
    return [x if v is None else v for x, v in zip(example_inputs, values)]


def shape_state(gm, example_inputs):
    """What the compile of a graph with symbolic sizes assumed about them, or None where its inputs have none:
    the ShapeEnv's guards, replacements and each symbol's range. A compile that changes this (AOTAutograd or
    ember guarding on a size) is not stored, as a hit would skip those guards (see backend._compile_graph)."""
    import torch

    env = None
    for x in _traced_values(gm, example_inputs):
        values = [x] if isinstance(x, torch.SymInt) else list(x.shape) + list(x.stride()) if isinstance(
            x, torch.Tensor) else []
        env = next((v.node.shape_env for v in values if isinstance(v, torch.SymInt)), env)
    if env is None:
        return None
    ranges = sorted((str(s), str(r)) for s, r in env.var_to_range.items())
    return (tuple(str(g.expr) for g in env.guards), tuple(sorted((str(a), str(b)) for a, b in env.replacements.items())),
            tuple(ranges))


@contextlib.contextmanager
def _outside_tracing():
    """No fake mode in sight: torch.load under Dynamo's tracing context (the backend runs inside it) gives meta
    tensors, without their values, where a fake mode is detected."""
    import torch._guards
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with torch._guards.tracing(None), unset_fake_temporarily():
        yield


def load(k):
    """The entry stored under key k, or None (a miss)."""
    where = folder()
    if k is None or where is None:
        return None
    path = os.path.join(where, k + ".entry")
    if not os.path.exists(path):
        return None
    import torch

    try:
        with _outside_tracing():
            entry = torch.load(path, weights_only=True)
            if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != k:
                raise ValueError("another format or key")
            if entry.get("digest") != _digest({name: v for name, v in entry.items() if name != "digest"}):
                raise ValueError("its checksum does not match its contents")
        _check(entry)
    except Exception as e:  # unreadable, truncated, another version's: a miss
        _log.debug("ember: compile cache entry %s is unusable (%s: %s); compiling afresh", path, type(e).__name__, e)
        return None
    try:
        os.utime(path)  # least recently used goes first
    except OSError:
        pass
    return entry


def _digest(contents):
    """A checksum of an entry's contents: their structure, every value, and each tensor's dtype, sizes, strides,
    device and bytes. torch.load checks none of its own: a flipped byte in an IR string or in a constant's data
    loads as another entry, which compiled and gave other results (an index out of bounds, a wrong gradient).
    Raises ValueError on a value no entry holds."""
    import ctypes

    import torch

    tensors = []

    def outline(v):
        t = type(v)
        if t is dict:
            return ("dict", [(outline(name), outline(x)) for name, x in v.items()])
        if t in (list, tuple):
            return (t.__name__, [outline(x) for x in v])
        if v is None or t in (str, int, float, bool):
            return v
        if t is torch.Tensor and v.layout == torch.strided and not v.is_meta:
            tensors.append(v)
            return ("tensor", str(v.dtype), tuple(v.shape), v.stride(), v.storage_offset(), str(v.device),
                    v.requires_grad)
        raise ValueError(f"a {t.__name__} in the entry")

    digest = hashlib.sha256(repr(outline(contents)).encode())
    for t in tensors:
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if data.numel():
            digest.update(ctypes.string_at(data.data_ptr(), data.numel()))
    return digest.hexdigest()


def _check(entry):
    """Raises ValueError where an entry's fields are not what store() writes, or disagree with each other or with
    the IR of its graphs. The checksum keeps out damage; this keeps out an entry written wrong, as the C++ calls
    take these fields on trust (python_bindings/training_graph.cpp reads one tangent per output that requires
    grad)."""
    kind, graphs = entry.get("kind"), entry.get("graphs")
    _need(kind in ("inference", "training"), f"kind {kind!r:.40}")
    _need(type(graphs) is list and len(graphs) == (1 if kind == "inference" else 2) and
          all(type(g) is dict for g in graphs), "not the graphs of its kind")
    (inputs, outputs), *backward = [_check_graph(g) for g in graphs]
    _need(_bools(entry.get("pinned")) and len(entry["pinned"]) in (0, len(inputs)), "pinned")
    _need(_ints(entry.get("bump", []), len(inputs)), "bump")
    dims = entry.get("dynamic_dims", [])
    _need(type(dims) is list and (kind == "inference" or not dims), "dynamic_dims")  # none for training graphs
    for item in dims:
        _need(type(item) in (list, tuple) and len(item) == 2 and type(item[0]) is int and
              0 <= item[0] < len(outputs), "dynamic_dims: no such output")
        layout = outputs[item[0]][1]
        _need(layout is not None and _ints(item[1], len(layout[0])), "dynamic_dims: no such dim")
    if kind == "inference":
        return
    spec = entry.get("spec")
    _need(type(spec) is dict and set(spec) == {"output_requires_grad", "saved_checked", "saved_unchecked",
                                               "tangents", "no_edge", "deterministic"}, "spec: fields")
    requires, tangents, no_edge = spec["output_requires_grad"], spec["tangents"], spec["no_edge"]
    saved = spec["saved_checked"], spec["saved_unchecked"]
    _need(_bools(requires) and _ints(saved) and _bools(no_edge), "spec: types")
    _need(type(spec["deterministic"]) is int and spec["deterministic"] in (-1, 0, 1), "spec: deterministic")
    ((grad_inputs, grads),) = backward
    _need(len(outputs) == len(requires) + sum(saved), "spec: not the forward's outputs")
    # As joint.py and _plain_metadata have them: no output an input (the C++ call would give a parameter autograd
    # history, for the rest of the process) and none twice.
    returned = [text for text, _ in outputs[:len(requires)] if text.startswith("%")]
    _need(len(set(returned)) == len(returned) and not set(returned) & {text for text, _ in inputs},
          "spec: an output that is an input, or twice")
    _need(len(grad_inputs) == sum(saved) + sum(requires), "spec: not the backward's inputs")
    _need(len(grads) == len(inputs) == len(no_edge), "spec: not one gradient per input")
    _need(all(text == "None" for (text, _), none in zip(grads, no_edge) if none), "spec: no_edge")
    _need(type(tangents) is list and len(tangents) == sum(requires), "spec: not one tangent per output with grad")
    for tangent, (_, declared) in zip(tangents, grad_inputs[sum(saved):]):
        _need(type(tangent) in (list, tuple) and len(tangent) == 3 and type(tangent[0]) is int, "spec: tangent")
        memory_format, sizes, strides = tangent
        _need(_ints(sizes) and _ints(strides) and declared is not None, "spec: tangent")
        if memory_format == -1:
            _need(declared == (list(sizes), list(strides)), "spec: not the backward's tangent")
        else:  # c10::MemoryFormat: contiguous (any rank), channels_last (4-d), channels_last_3d (5-d)
            rank = {0: None, 2: 4, 3: 5}
            _need(memory_format in rank and rank[memory_format] in (None, len(declared[0])), "spec: tangent format")


def _need(ok, what):
    if not ok:
        raise ValueError(what)


def _bools(v):
    return type(v) is list and all(type(b) is bool for b in v)


def _ints(v, below=None):
    """Whether v is a list or tuple of ints in [0, below)."""
    return type(v) in (list, tuple) and all(type(i) is int and 0 <= i and (below is None or i < below) for i in v)


_TENSOR_TYPE = re.compile(r"\w+\[(.*)\]\{(.*)\}@\S+")  # f32[16, s0]{s0, 1}@cpu


def _check_graph(graph):
    """One graph of an entry: its fields' types, its IR's outline, and the constants the IR reads against those
    stored (the same names; each of the dtype, sizes, strides and device declared). Returns its inputs and
    outputs, each (text, layout): layout is the ([sizes], [strides]) declared (ints, or expressions as text),
    or None where the value is no tensor (an output that is a literal: text "None")."""
    import torch

    from .lower import string_text, type_text

    ir, constants, pinned = graph.get("ir"), graph.get("constants"), graph.get("pinned")
    _need(type(ir) is str and type(constants) is dict and _bools(pinned), "graph: fields")
    _need(type(graph.get("fx_nodes")) is int and graph["fx_nodes"] >= 0 and type(graph.get("cuda")) is bool,
          "graph: fields")
    padding = graph.get("padding")  # (the plan or None, why not): the C++ side checks the plan's indices
    _need(padding is None or (type(padding) in (list, tuple) and len(padding) == 2 and type(padding[1]) is str),
          "graph: padding")
    for name, t in constants.items():
        _need(type(name) is str and type(t) is torch.Tensor and t.layout == torch.strided, "graph: constants")
        _need(not t.is_meta, "a constant without its values")
    lines = ir.rstrip("\n").split("\n")
    _need(len(lines) >= 2 and lines[0].startswith("graph(") and lines[0].endswith("):"), "IR: no signature")
    _need(lines[-1].startswith("  return (") and lines[-1].endswith(")"), "IR: no return")
    types = {}  # value name -> the type text of its first declaration

    def declare(text):
        declared = []
        for decl in text.split(", %"):  # no type text holds ", %"
            name, colon, kind = decl.removeprefix("%").partition(": ")
            _need(bool(colon), "IR: a declaration")
            types.setdefault(name, kind)
            declared.append((name, kind))
        return declared

    inputs = [name for name, _ in declare(lines[0][len("graph("):-len("):")])] if lines[0] != "graph():" else []
    _need(len(pinned) == len(inputs), "graph: pinned")
    read = {}  # string_text(constant name) -> the type text declared for it
    for line in lines[1:-1]:
        _need(line.startswith("  "), "IR: a line")
        if not line.startswith("  %"):  # a call without results
            continue
        left, _, call = line[2:].partition(" = ")  # no type text holds " = "
        declared = declare(left)
        if call.startswith("prim::constant(") and call.endswith(")"):
            _need(len(declared) == 1, "IR: a constant")
            kind = declared[0][1]
            _need(read.setdefault(call[len("prim::constant("):-1], kind) == kind, "IR: one constant of two types")
    _need(set(read) == {string_text(name) for name in constants}, "IR and constants: not the same names")
    for name, t in constants.items():
        _need(read[string_text(name)] == type_text(t), f"IR and constants: {name!r:.40} is not as declared")

    def value(text):
        match = _TENSOR_TYPE.fullmatch(types.get(text[1:], "")) if text.startswith("%") else None
        if match is None:
            return text, None
        return text, tuple([int(d) if d.isdigit() else d for d in part.split(", ")] if part else []
                           for part in match.groups())

    results = _split_top_level(lines[-1][len("  return ("):-1])
    return [value("%" + name) for name in inputs], [value(text) for text in results]


def _split_top_level(text):
    """'%a, [1, 2], None' -> ['%a', '[1, 2]', 'None'] (the IR's return list)."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c in "([{") - (c in ")]}")
        if c == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if text.strip():
        parts.append(text[start:].strip())
    return parts


def store(k, entry):
    """Writes entry under key k (a temporary file renamed into place), then evicts past the size cap."""
    where = folder()
    if k is None or where is None or not entry.get("graphs"):
        return
    import torch

    def write(f):
        with _outside_tracing():
            contents = dict(entry, format=FORMAT, key=k)
            torch.save(dict(contents, digest=_digest(contents)), f)

    try:
        _write_atomically(os.path.join(where, k + ".entry"), write)
    except Exception as e:  # a full or read-only disk: no entry, nothing else lost
        _log.debug("ember: compile cache entry %s not written (%s: %s)", k, type(e).__name__, e)
        return
    _evict(config.compile_cache_mb * 2**20)


def _write_atomically(path, write):
    """write(file) into a temporary file beside `path`, then renamed to it: a reader sees the old file or the
    whole new one, and processes writing one path at once leave one whole file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=os.path.splitext(path)[1])
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _evict(cap):
    held = entries()
    total = sum(size for _, size in held)
    for path, size in held:
        if total <= cap:
            break
        try:
            os.remove(path)
            total -= size
        except OSError:
            pass


# Artifacts: a zip of the files below, by their names under the cache's root.
_ARTIFACT_NAMES = re.compile(r"(graphs/[0-9a-f]{64}\.entry|[0-9a-f]{16}\.cubin)")
_MANIFEST = "ember-cache-artifacts"


def save_artifacts():
    """The compile cache's entries and the CUDA kernel cache's kernels, as bytes for load_artifacts (b"" where the
    caches are off)."""
    import io
    import zipfile

    root = _root()
    if root is None:
        return b""
    names = [n for n in os.listdir(root) if _ARTIFACT_NAMES.fullmatch(n)] if os.path.isdir(root) else []
    names += ["graphs/" + os.path.basename(path) for path, _ in entries()]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr(_MANIFEST, str(FORMAT))
        for name in sorted(set(names)):
            if _ARTIFACT_NAMES.fullmatch(name):
                try:
                    z.write(os.path.join(root, name), name)
                except OSError:  # evicted meanwhile
                    pass
    return out.getvalue()


def load_artifacts(data):
    """Installs what save_artifacts returned (here or on another machine) into this process's caches; returns how
    many files it wrote. Bytes that are not such artifacts raise EmberError, and nothing is written; an entry of
    another ember, torch or GPU is written but never matches a key (a miss)."""
    import io
    import zipfile

    from .errors import EmberError

    root = _root()
    if root is None:
        return 0
    try:
        z = zipfile.ZipFile(io.BytesIO(bytes(data)))
        if z.read(_MANIFEST).decode() != str(FORMAT):
            raise ValueError(f"format {z.read(_MANIFEST)[:20]!r}, this ember reads {FORMAT}")
        members = [(i.filename, z.read(i)) for i in z.infolist() if _ARTIFACT_NAMES.fullmatch(i.filename)]
    except Exception as e:
        raise EmberError(f"ember.load_cache_artifacts: not ember cache artifacts ({type(e).__name__}: {e})") from None
    written = 0
    for name, payload in members:
        if name.startswith("graphs/") and folder() is None:
            continue
        _write_atomically(os.path.join(root, name), lambda f: f.write(payload))
        written += 1
    _evict(config.compile_cache_mb * 2**20)
    return written
