"""ember.config: every setting ember reads, typed and documented in one place.

    ember.config.fallback = "raise"                      # from here on, in this process
    with ember.config.patch(gemm_route="aten"):          # for a block (tests), restored after it
        ...
    torch.compile(model, backend="ember", options={"fallback": "raise"})   # an option, for one compile

Each setting has a name, a type, a default, an environment variable (EMBER_ and, mostly, its name in capitals),
a one-line effect and a category: "user" settings are what a user of ember sets; "debug" ones switch an
optimization off or force a route, for developers narrowing a problem down. docs/configuration.md is the table
of them all (markdown_table() writes it; test_config.py checks the two agree).

Where a value comes from, the first that applies: the torch.compile `options=` of that compile (settings marked
`option` only), a value set in code (`ember.config.x = ...`, patch), the environment variable, the default. The
environment is read once, at the first use of any setting (not at `import ember`), and every value is checked
then: a bad one raises ember.EmberError naming the variable.

The C++ side reads its settings through ember::config_value (backend/include/ember/config.h), never the
environment: each setting marked `cpp` is pushed there when the extension loads (_C.py) and again whenever it
changes. Some C++ settings are read once per process, at their first use (`read once` in the table); changing
those later has no effect.
"""

import contextlib
import difflib
import os
import sys
import types

from .errors import EmberError

USER = "user"
DEBUG = "debug"


class Setting:
    """One setting. `kind`: bool, int, str, a tuple of the accepted strings, "names" (a list of names, also
    a comma-separated string), "ints" (a list of ints >= 0, also one int or "0,1") or "buckets" (None, "pow2", or
    a list of sizes >= 1, also "8,16,32"). `default` None (for a bool): decided elsewhere, as the doc says."""

    def __init__(self, name, kind, default, doc, category, env=None, option=False, cpp=False, minimum=None,
                 read_once=False):
        self.name, self.kind, self.default, self.doc, self.category = name, kind, default, doc, category
        self.env = env or "EMBER_" + name.upper()
        self.option, self.cpp, self.minimum, self.read_once = option, cpp, minimum, read_once

    def type_name(self):
        if isinstance(self.kind, tuple):
            return " / ".join(f'"{c}"' for c in self.kind)
        if self.kind == "names":
            return "list of names"
        if self.kind == "ints":
            return "list of ints >= 0"
        if self.kind == "buckets":
            return '"pow2" or list of ints >= 1 or None'
        name = self.kind.__name__
        if self.kind is int and self.minimum is not None:
            return f"int >= {self.minimum}"
        return name + " or None" if self.default is None else name

    def check(self, value, source):
        """`value` as this setting holds it, or EmberError; `source` names where it came from in the message."""
        if self.kind is bool:
            if value is None and self.default is None:
                return None
            if isinstance(value, bool):
                return value
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            if isinstance(value, str) and value.strip().lower() in _BOOL_TEXT:
                return _BOOL_TEXT[value.strip().lower()]
            raise EmberError(f"{source} must be a boolean, not {value!r}")
        if self.kind is int:
            if isinstance(value, bool) or not isinstance(value, int) or (self.minimum is not None and value < self.minimum):
                at_least = f" >= {self.minimum}" if self.minimum is not None else ""
                raise EmberError(f"{source} must be an integer{at_least}, not {value!r}")
            return value
        if self.kind == "names":
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise EmberError(f"{source} must be a list of names or a comma-separated string, not {value!r}")
            return tuple(value)
        if self.kind in ("ints", "buckets"):
            return _check_ints(self.kind, value, source)
        if isinstance(self.kind, tuple):
            if value not in self.kind:
                raise EmberError(f"{source} must be one of {', '.join(repr(c) for c in self.kind)}, not {value!r}")
            return value
        if value is None:
            return ""
        if not isinstance(value, (str, os.PathLike)):
            raise EmberError(f"{source} must be a string, not {value!r}")
        return os.fspath(value)

    def parse(self, text):
        """The value an environment variable's text stands for; empty text: the default."""
        if text.strip() == "":
            return self.default
        value = text
        if self.kind is int:
            try:
                value = int(text)
            except ValueError:
                pass
        return self.check(value, self.env)

    def cpp_text(self, value):
        """The string C++ reads for `value` (config_value); None where the setting is unset."""
        if value is None or value == "":
            return None
        if isinstance(value, bool):
            return "1" if value else "0"
        return str(value)


def _check_ints(kind, value, source):
    """A "ints" setting's value as a tuple, or a "buckets" one's as None, "pow2" or an ascending tuple of sizes."""
    if kind == "buckets" and (value is None or (isinstance(value, str) and value.strip().lower() in ("", "off", "none"))):
        return None
    if kind == "buckets" and isinstance(value, str) and value.strip().lower() == "pow2":
        return "pow2"
    items = value
    if isinstance(value, str):
        try:
            items = [int(v) for v in value.split(",") if v.strip()]
        except ValueError:
            items = None
    elif isinstance(value, int) and not isinstance(value, bool):
        items = [value]
    least = 1 if kind == "buckets" else 0
    if (not isinstance(items, (list, tuple)) or not items
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= least for v in items)):
        what = '"pow2", a list of sizes >= 1 or None' if kind == "buckets" else "a list of integers >= 0"
        raise EmberError(f"{source} must be {what}, not {value!r}")
    return tuple(sorted(set(items)))


_BOOL_TEXT = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}

_GEMM_KERNELS = ("auto", "t64", "t32", "t16", "s4", "s16", "k16", "k32")

SETTINGS = {s.name: s for s in (
    # ---- user settings
    Setting("fallback", ("warn", "raise"), "warn",
            'a graph ember cannot compile: "warn" runs it eagerly with one warning, "raise" raises ember.EmberError '
            "naming the node", USER, option=True),
    Setting("disable_passes", "names", (),
            "passes to skip, by name (`ember._C.pass_names()`, docs/architecture.md's table; overlap_comm: functional "
            'collectives\' waits where their results are first read): a list or a comma-separated string ("dce,cse")',
            USER, option=True),
    Setting("debug_dir", str, "",
            "a directory to write each graph's FX graph, IR after every pass, kernels and plan into; empty: none",
            USER, env="EMBER_DEBUG", option=True),
    Setting("cudagraphs", bool, None,
            'capture CUDA graphs; None: on in mode="reduce-overhead" and "max-autotune", off otherwise', USER, option=True),
    Setting("cudagraph_warmup", int, 1,
            "eager calls of a new input signature before its CUDA graph capture", USER, option=True, minimum=0),
    Setting("cudagraph_max_graphs", int, 8,
            "input signatures captured per graph; past it the least recently used one gives its graphs up, with one "
            "warning", USER, option=True, minimum=1),
    Setting("autotune", bool, None,
            'time every candidate of each CUDA GEMM, and every launch configuration of each fused CUDA kernel, at '
            "its first call, and each CUDA attention call's kernels at compile time, within autotune_budget_s (and "
            "run CUDA convolutions with cuDNN's benchmark search, time "
            "every CPU matmul's libraries and each fused CPU kernel's thread count); None: on in "
            'mode="max-autotune" and "max-autotune-no-cudagraphs" (torch.compile takes a mode or options, not both), '
            "off otherwise", USER, option=True),
    Setting("autotune_budget_s", int, 30,
            "with autotune: seconds each compiled graph may spend timing its CUDA GEMMs' candidates, fused CUDA "
            "kernels' launches, attention kernels and fused CPU kernels' threads; problems met after it is spent get "
            "the default mode's choice; 0: none tuned beyond it. Timed GEMM choices, in every mode, are kept in "
            "<cache_dir>/gemm for later processes, timed launches in <cache_dir>/launch, attention kernels in "
            "<cache_dir>/attention, timed CPU choices in <cache_dir>/cpu",
            USER, option=True, minimum=0),
    Setting("parameter_cache", bool, True,
            "inference graphs run their steps over parameters alone (weight layouts, folded batch norms; without CUDA "
            "graphs, a symbolic graph's steps over its sizes and parameters, per size) again only when a parameter "
            "changes; off where parameters change through `.data`, which ember cannot see",
            USER, option=True),
    Setting("pad_to_buckets", "buckets", None,
            "inference graphs over a symbolic size (dynamic=True, automatic dynamic, mark_dynamic) run it padded with "
            'zeros up to a bucket ("pow2": the next power of two; a list: the smallest listed size that holds it, '
            "larger sizes unpadded) and slice their outputs back, so that reduce-overhead captures few sizes; correct "
            "only where rows along the padded dim are independent (docs/configuration.md, Sizes that vary); None: off",
            USER, option=True),
    Setting("pad_dims", "ints", (0,),
            "with pad_to_buckets: the input dims whose symbolic size is padded (every input and output of that size "
            "follows it); 0: the batch dim", USER, option=True),
    Setting("cache_dir", str, "",
            'the directory of the disk caches (CUDA kernels, timed GEMM, launch and CPU choices, whole compiles); '
            'empty: '
            '~/.cache/ember; "off": none', USER,
            cpp=True),
    Setting("compile_cache", bool, True,
            "whole compiles (the IR after tracing and lowering) kept in <cache_dir>/graphs, so that a restarted "
            "process skips tracing (ember/cache.py)", USER),
    Setting("compile_cache_mb", int, 1024,
            "the compile cache's size cap in MiB; past it the least recently used entries go", USER, minimum=1),
    Setting("compile_threads", int, 0,
            "kernels generated and compiled at once (code generation and NVRTC); 0: the hardware's threads", USER,
            cpp=True, minimum=0, read_once=True),
    Setting("cuda_background", bool, True,
            "fused CUDA kernels no cache holds compile on threads of their own while calls run their ATen ops; "
            "off: they compile before the first call (`ember.wait_for_compiles()` waits for them)", USER, cpp=True),
    Setting("nvrtc_path", str, "",
            "the libnvrtc to load; empty: the one torch's CUDA wheels install, else the system's", USER, cpp=True,
            read_once=True),
    # ---- debug settings: an optimization off, or a route forced
    Setting("direct_call", bool, True,
            "Dynamo calls the C++ graph itself where AOTAutograd's wrapper would do nothing; off keeps the wrappers "
            "(and sends every graph through AOTAutograd)", DEBUG),
    Setting("direct_trace", bool, True,
            "inference graphs AOTAutograd would add nothing to are traced in one pass (trace.py); off: through "
            "AOTAutograd", DEBUG),
    Setting("trace_by_node", bool, None,
            "trace repeated layers once per distinct call (trace.py, joint.py); None: where calls repeat enough, "
            "True: wherever it can, False: never (training graphs then go through AOTAutograd)", DEBUG),
    Setting("pause_gc", bool, True,
            "Python's garbage collector paused while ember compiles, full collections held off while Dynamo "
            "compiles for ember", DEBUG),
    Setting("fused_attention", bool, True,
            "CUDA attention routed to the flash, memory-efficient or cuDNN kernel (attention.py)", DEBUG),
    Setting("cudnn_attention", bool, True,
            "16-bit attention on Hopper tries cuDNN's kernel first; off: flash or memory-efficient", DEBUG),
    Setting("keep_masks", bool, False,
            "attention masks computed from constants are kept; off: dropped where they mask nothing, "
            "is_causal where causal", DEBUG),
    Setting("flex_kernel", bool, True,
            "flex_attention on CUDA runs ember's kernel (flex.py); off: dense ATen ops", DEBUG),
    Setting("flex_wgmma", bool, True,
            "ember's flex_attention kernel takes its products from wgmma on Hopper; off: m16n8k16 MMAs everywhere",
            DEBUG, cpp=True),
    Setting("conv_channels_last", bool, True,
            "convolutions run channels-last where that pays, and 1x1 average pools trace as their mean (layout.py)", DEBUG),
    Setting("embedding_grad", ("ember", "aten"), "ember",
            "embedding_dense_backward as ember::embedding_grad (decompositions.py), or ATen's kernel", DEBUG),
    Setting("cublaslt", bool, True,
            "CUDA GEMMs through prepared cuBLASLt calls, timed per problem; off: every GEMM an ATen call", DEBUG,
            cpp=True, read_once=True),
    Setting("gemm_route", ("auto", "lt", "lt_bias", "aten", "padded", "kernel"), "auto",
            "CUDA GEMMs: the fastest route timed per problem, or this one forced (kernels/cuda/gemm.cpp)", DEBUG,
            cpp=True),
    Setting("gemm_kernel", _GEMM_KERNELS, "auto",
            'with gemm_route="kernel": which of ember\'s GEMM kernels, else the fastest', DEBUG, cpp=True),
    Setting("cpu_matmul", ("auto", "onednn", "aten", "torch"), "auto",
            "CPU matmuls of 2^22 multiply-adds or more: the library timed fastest per problem, or this one "
            "(kernels/cpu/matmul_kernel.cpp)", DEBUG, cpp=True),
    Setting("cpu_conv", ("torch", "aten"), "torch",
            "CPU convolutions with an epilogue: torch's oneDNN call with post-ops, or plain ATen", DEBUG, cpp=True),
    Setting("onednn_conv", bool, False,
            "CPU convolutions through ember's own oneDNN, with any epilogue, instead of torch's", DEBUG, cpp=True),
    Setting("training_matmuls", ("aten", "onednn"), "aten",
            "a lone matmul in a training graph: ATen's, or claimed for oneDNN (passes/matmul_epilogue.cpp)", DEBUG,
            cpp=True),
)}

OPTIONS = tuple(name for name, s in SETTINGS.items() if s.option)

_values = None  # {name: value}, filled at the first use (_current)


def parse_environment(environ):
    """{name: value} of the settings `environ` (a mapping like os.environ) sets; EmberError for a bad value."""
    return {s.name: s.parse(environ[s.env]) for s in SETTINGS.values() if s.env in environ}


def _current():
    global _values
    if _values is None:
        values = {name: s.default for name, s in SETTINGS.items()}
        values.update(parse_environment(os.environ))
        _values = values
    return _values


def _setting(name):
    setting = SETTINGS.get(name)
    if setting is None:
        raise _UnknownSetting(_unknown_message("setting", [name], SETTINGS))
    return setting


def _unknown_message(what, names, known):
    parts = []
    for name in names:
        close = difflib.get_close_matches(str(name), list(known), n=3)
        parts.append(repr(name) + (f" (did you mean {', '.join(close)}?)" if close else ""))
    return f"unknown {what}(s) {', '.join(parts)}; ember accepts: {', '.join(known)}"


class _UnknownSetting(EmberError, AttributeError):
    """An unknown setting's name: an EmberError, and an AttributeError so that getattr/hasattr behave."""


def _push(setting, value):
    native = sys.modules.get("ember._native")  # not loaded yet: _C.py pushes every setting when it loads
    if setting.cpp and native is not None:
        native.set_config(setting.env, setting.cpp_text(value))


def push_all(set_config):
    """Hands every C++ setting to the extension (`_C.set_config`); _C.py calls it as the extension loads."""
    values = _current()
    for setting in SETTINGS.values():
        if setting.cpp:
            set_config(setting.env, setting.cpp_text(values[setting.name]))


def _get(name):
    return _current()[_setting(name).name]


def _set(name, value):
    setting = _setting(name)
    value = setting.check(value, f"ember.config.{name}")
    _current()[name] = value
    _push(setting, value)


@contextlib.contextmanager
def patch(**changes):
    """Sets the settings given for the block and restores them after it (also a decorator):

        with ember.config.patch(fallback="raise", gemm_route="aten"):
            ...
    """
    saved = {name: _get(name) for name in changes}
    try:
        for name, value in changes.items():
            _set(name, value)
        yield
    finally:
        for name, value in saved.items():
            _set(name, value)


def resolve_options(options):
    """{option name: value} for one torch.compile: `options=` over the process's settings. Every name and value
    is checked here, before anything is traced; EmberError for an unknown option or a bad value."""
    options = dict(options or {})
    unknown = [name for name in options if name not in OPTIONS]
    settings_only = [name for name in unknown if name in SETTINGS]
    if settings_only:
        name = settings_only[0]
        raise EmberError(f"{name!r} is a process-wide setting, not a torch.compile option: set ember.config.{name} "
                         f"or {SETTINGS[name].env}; options accepts: {', '.join(OPTIONS)}")
    if unknown:
        raise EmberError(_unknown_message("option", unknown, OPTIONS))
    values = _current()
    resolved = {name: values[name] for name in OPTIONS}
    for name, value in options.items():
        resolved[name] = SETTINGS[name].check(value, name)
    return resolved


def _default_text(setting):
    if setting.default is None:
        return "None"
    if setting.kind == "names":
        return "none"
    if setting.kind == "ints":
        return ", ".join(str(v) for v in setting.default)
    if isinstance(setting.default, str):
        return f'"{setting.default}"'
    return str(setting.default)


def markdown_table(category):
    """The table of one category's settings, as docs/configuration.md holds it."""
    rows = ["| setting | environment | type | default | effect |", "|---|---|---|---|---|"]
    for s in SETTINGS.values():
        if s.category != category:
            continue
        notes = [n for n, on in (("option", s.option), ("read by C++", s.cpp), ("read once", s.read_once)) if on]
        effect = s.doc + (f" ({', '.join(notes)})" if notes else "")
        rows.append(f"| `{s.name}` | `{s.env}` | {s.type_name()} | {_default_text(s)} | {effect} |")
    return "\n".join(rows) + "\n"


class _ConfigModule(types.ModuleType):
    """ember.config itself: its settings read and written as attributes (ember.config.fallback = "raise")."""

    def __getattr__(self, name):  # only names the module does not hold: the settings
        if name.startswith("__"):
            raise AttributeError(name)
        return _get(name)

    def __setattr__(self, name, value):
        if name in SETTINGS:
            _set(name, value)
        elif name.startswith("_") or name in self.__dict__:
            super().__setattr__(name, value)
        else:
            _setting(name)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(SETTINGS))


sys.modules[__name__].__class__ = _ConfigModule
