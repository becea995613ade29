"""ember.config (python_bindings/ember/config.py): docs/configuration.md shows exactly its settings, the code uses no
EMBER_* name that is not one of them (or a build option or test-harness variable the doc lists), values are checked by
type wherever they come from (options=, code, the environment), patch() restores, and C++ reads what Python set."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import ember
import ember._C
import ember.config
from ember import EmberError

from helpers import EMBER_GRAPHS

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
NAME = re.compile(r"\bEMBER_[A-Z0-9_]+\b")
# Where ember's code and its user-facing text live (CHANGELOG.md is history: it may name settings that are gone).
SCANNED = ("backend", "kernels", "passes", "cudagraph", "python_bindings", "test", "bench", "examples", ".ci", "docs")
SCANNED_FILES = ("README.md", "CMakeLists.txt")
SUFFIXES = (".py", ".cpp", ".h", ".cu", ".sh", ".md", ".txt", ".cmake", ".yml")
# EMBER_* names that are neither settings nor build-time: test-harness variables (docs/configuration.md lists
# them) and Python names in tests and benchmarks.
HARNESS = {"EMBER_TEST_BACKGROUND", "EMBER_TEST_COMPILE_CACHE", "EMBER_FUZZ_COUNT", "EMBER_PACKAGE_TEST_DIR", "EMBER_PACKAGE_DEVICE",
           "EMBER_GPU_BENCH", "EMBER_EDITABLE"}
PYTHON_NAMES = {"EMBER_GRAPHS", "EMBER_OPTIONS", "EMBER_OK"}  # helpers' graph list, bench's options, a printed marker


def _doc():
    with open(os.path.join(ROOT, "docs", "configuration.md")) as f:
        return f.read()


def _source_files():
    for top in SCANNED:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d not in ("build", "__pycache__")]
            for name in files:
                if name.endswith(SUFFIXES):
                    yield os.path.join(folder, name)
    for name in SCANNED_FILES:
        yield os.path.join(ROOT, name)


def _read(path):
    with open(path, errors="replace") as f:
        return f.read()


@pytest.mark.parametrize("category", [ember.config.USER, ember.config.DEBUG])
def test_doc_tables_are_the_settings(category):
    table = ember.config.markdown_table(category)
    assert table in _doc(), (f"docs/configuration.md's {category} table differs from ember.config's; paste "
                             f"ember.config.markdown_table({category!r}):\n{table}")


def test_every_ember_name_in_the_code_is_a_setting_or_listed():
    settings = {s.env for s in ember.config.SETTINGS.values()}
    build, used = set(), {}
    skipped = (os.path.join(ROOT, "docs", "configuration.md"), os.path.abspath(__file__))  # they name removed ones
    for path in _source_files():
        text = _read(path)
        if os.path.basename(path) == "CMakeLists.txt" or path.endswith(".cmake"):
            build |= set(re.findall(r"EMBER_[A-Z0-9_]+", text))  # CMake options, variables, definitions (-DEMBER_...)
        build |= set(re.findall(r"#\s*define\s+(EMBER_[A-Z0-9_]+)", text))  # C++ macros
        if path not in skipped:
            for name in NAME.findall(text):
                used.setdefault(name, os.path.relpath(path, ROOT))
    unknown = {name: where for name, where in used.items()
               if name not in settings | build | HARNESS | PYTHON_NAMES}
    assert not unknown, ("EMBER_* names that are no ember.config setting, build option or listed test variable "
                         f"(add a Setting to python_bindings/ember/config.py, or drop the name): {unknown}")
    doc = _doc()
    assert all(f"`{name}`" in doc for name in HARNESS), "docs/configuration.md must list the test-harness variables"


def test_only_config_reads_the_environment():
    """C++ reads settings through ember::config_value, Python through ember.config; the few reads left are of
    variables that are not ember's (docs/configuration.md, "Other variables")."""
    allowed = {
        "backend/config.cpp": "environ",  # the settings of a C++ program without Python
        "kernels/cuda/disk_cache.cpp": '"HOME"',
        "kernels/cpu/dispatch.cpp": '"ATEN_CPU_CAPABILITY"',
        "python_bindings/ember/config.py": "os.environ",
        "python_bindings/ember/backend.py": '"TORCH_COMPILE_DEBUG"',
        "python_bindings/ember/joint.py": '"TORCH_COMPILE_DEBUG"',
    }
    reads = re.compile(r"\bgetenv\s*\(|\bos\.environ\b|\bos\.getenv\b|\bsetenv\s*\(")
    found = []
    for top in ("backend", "kernels", "passes", "cudagraph", "python_bindings"):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(folder, name)
                relative = os.path.relpath(path, ROOT)
                if not name.endswith((".py", ".cpp", ".h", ".cu")):
                    continue
                for number, line in enumerate(_read(path).split("\n"), 1):
                    if reads.search(line) and not line.lstrip().startswith(("//", "#")):
                        if relative not in allowed or allowed[relative] not in line:
                            found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "environment reads outside ember.config:\n" + "\n".join(found)


def test_unknown_setting_names_close_matches():
    with pytest.raises(EmberError, match=r"unknown setting\(s\) 'falback' \(did you mean fallback\?\)"):
        ember.config.falback
    with pytest.raises(EmberError, match="did you mean gemm_route"):
        ember.config.gemm_rout = "aten"
    with pytest.raises(EmberError, match="unknown setting"):
        with ember.config.patch(no_such_setting=1):
            pass
    assert not hasattr(ember.config, "no_such_setting")  # an AttributeError too


def test_values_are_checked_by_type(monkeypatch):
    monkeypatch.setattr(ember.config, "cudagraph_warmup", 3)
    assert ember.config.cudagraph_warmup == 3
    for name, bad, message in [
        ("cudagraph_warmup", -1, "must be an integer >= 0"),
        ("cudagraph_warmup", "3", "must be an integer"),
        ("cudagraph_warmup", True, "must be an integer"),
        ("fallback", "ignore", "must be one of 'warn', 'raise'"),
        ("pause_gc", "sometimes", "must be a boolean"),
        ("disable_passes", 3, "list of names"),
        ("gemm_route", "fastest", "must be one of 'auto'"),
    ]:
        with pytest.raises(EmberError, match=message):
            setattr(ember.config, name, bad)
    monkeypatch.setattr(ember.config, "disable_passes", "cse, dce")
    assert ember.config.disable_passes == ("cse", "dce")


def test_environment_text_is_parsed():
    parsed = ember.config.parse_environment({
        "EMBER_PAUSE_GC": "off", "EMBER_DIRECT_CALL": "true", "EMBER_KEEP_MASKS": "1", "EMBER_CUDAGRAPHS": "",
        "EMBER_CUDAGRAPH_MAX_GRAPHS": "4", "EMBER_DISABLE_PASSES": "dce,cse", "EMBER_GEMM_ROUTE": "aten",
        "EMBER_TRACE_BY_NODE": "0", "EMBER_DEBUG": "/tmp/dump", "PATH": "/bin", "EMBER_GEMM_LOG": "1",
    })
    assert parsed == {"pause_gc": False, "direct_call": True, "keep_masks": True, "cudagraphs": None,
                      "cudagraph_max_graphs": 4, "disable_passes": ("dce", "cse"), "gemm_route": "aten",
                      "trace_by_node": False, "debug_dir": "/tmp/dump"}  # a removed name is ignored
    for variable, text, message in [("EMBER_PAUSE_GC", "2", "EMBER_PAUSE_GC must be a boolean, not '2'"),
                                    ("EMBER_CPU_MATMUL", "mkl", "EMBER_CPU_MATMUL must be one of"),
                                    ("EMBER_COMPILE_THREADS", "-2", "EMBER_COMPILE_THREADS must be an integer >= 0")]:
        with pytest.raises(EmberError, match=message):
            ember.config.parse_environment({variable: text})


def test_patch_restores_also_when_the_block_raises():
    before = (ember.config.fallback, ember.config.gemm_route)
    with pytest.raises(ValueError):
        with ember.config.patch(fallback="raise", gemm_route="aten"):
            assert (ember.config.fallback, ember.config.gemm_route) == ("raise", "aten")
            assert ember._C.get_config("EMBER_GEMM_ROUTE") == "aten"
            raise ValueError
    assert (ember.config.fallback, ember.config.gemm_route) == before
    assert ember._C.get_config("EMBER_GEMM_ROUTE") == "auto"

    @ember.config.patch(keep_masks=True)
    def decorated():
        return ember.config.keep_masks

    assert decorated() is True and ember.config.keep_masks is False


def test_cpp_reads_what_python_set(monkeypatch):
    monkeypatch.setattr(ember.config, "cublaslt", False)
    monkeypatch.setattr(ember.config, "compile_threads", 3)
    monkeypatch.setattr(ember.config, "cache_dir", "")
    assert ember._C.get_config("EMBER_CUBLASLT") == "0"
    assert ember._C.get_config("EMBER_COMPILE_THREADS") == "3"
    assert ember._C.get_config("EMBER_CACHE_DIR") is None  # empty: unset, C++'s default (~/.cache/ember)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without mkldnn")
@pytest.mark.parametrize("route", ["torch", "aten"])
def test_a_cpp_setting_changes_the_plan(route, monkeypatch):
    """cpu_conv, read by passes/matmul_epilogue.cpp at each compile: torch's oneDNN convolution, or ATen's."""
    monkeypatch.setattr(ember.config, "cpu_conv", route)
    conv = torch.nn.Conv2d(3, 8, 3).eval()
    compiled = torch.compile(lambda x: torch.relu(conv(x)), backend="ember")
    x = torch.randn(1, 3, 9, 9)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), torch.relu(conv(x)), rtol=1e-4, atol=1e-4)
    steps = [what for _, g in EMBER_GRAPHS for _, what in g.steps()]
    assert ("aten::convolution" in steps) == (route == "aten"), steps


def test_options_are_checked_before_tracing():
    resolve = ember.config.resolve_options
    assert resolve({"fallback": "raise", "cudagraphs": 1})["cudagraphs"] is True
    with pytest.raises(EmberError, match=r"unknown option\(s\) 'fallbak' \(did you mean fallback\?\)"):
        resolve({"fallbak": "raise"})
    with pytest.raises(EmberError, match="'gemm_route' is a process-wide setting.*ember.config.gemm_route"):
        resolve({"gemm_route": "aten"})
    with pytest.raises(EmberError, match="parameter_cache must be a boolean"):
        resolve({"parameter_cache": "maybe"})
    # Through torch.compile: at the first call, before Dynamo traces anything ember would compile.
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(EmberError, match="fallbak"):
        ember.backend.ember_backend(gm, [torch.randn(2)], options={"fallbak": "raise"})
    assert EMBER_GRAPHS == []


def test_options_take_precedence_over_the_config(monkeypatch):
    monkeypatch.setattr(ember.config, "fallback", "raise")
    monkeypatch.setattr(ember.config, "cudagraph_warmup", 2)
    resolved = ember.config.resolve_options({"fallback": "warn"})
    assert resolved["fallback"] == "warn" and resolved["cudagraph_warmup"] == 2
    assert ember.config.fallback == "raise"  # one compile's options leave the setting alone


def test_environment_is_read_once_at_first_use_in_a_fresh_process():
    code = textwrap.dedent("""
        import os, sys
        import ember
        os.environ["EMBER_GEMM_ROUTE"] = "aten"  # set after the import, before the first use: still read
        assert ember.config.fallback == "raise"
        os.environ["EMBER_FALLBACK"] = "warn"  # after the first use: not read again
        assert ember.config.fallback == "raise" and ember.config.gemm_route == "aten"
        ember.config.cpu_matmul = "aten"  # code over the environment
        import torch  # the extension links against torch's libraries
        import ember._C
        assert ember._C.get_config("EMBER_GEMM_ROUTE") == "aten"  # handed to C++ as the extension loads
        assert ember._C.get_config("EMBER_CPU_MATMUL") == "aten"
        assert ember._C.get_config("EMBER_CUBLASLT") == "1"
        print("CONFIG_OK")
    """)
    env = dict(os.environ, EMBER_FALLBACK="raise", EMBER_CPU_MATMUL="onednn")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd="/")
    assert r.returncode == 0 and "CONFIG_OK" in r.stdout, r.stdout + r.stderr
    bad = subprocess.run([sys.executable, "-c", "import ember; ember.config.fallback"], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, EMBER_CUDAGRAPH_WARMUP="two"), cwd="/")
    assert bad.returncode != 0 and "EMBER_CUDAGRAPH_WARMUP must be an integer >= 0, not 'two'" in bad.stderr
