import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import helpers  # noqa: E402


def pytest_configure(config):
    # ember's fallback warning means a graph ran eagerly: never let a test pass through it.
    config.addinivalue_line("filterwarnings", "error:ember could not compile:UserWarning")
    config.addinivalue_line("markers", "slow: a test that takes more than a few seconds")


@pytest.fixture(autouse=True)
def _ember_test_env(monkeypatch):
    """Fresh dynamo state, a fixed seed, ember's options at their defaults whatever the environment says, and a
    count of ember's graphs. Settings a test changes (monkeypatch.setattr(ember.config, ...)) are restored after it."""
    import ember.config

    for name in ember.config.OPTIONS:
        monkeypatch.setattr(ember.config, name, ember.config.SETTINGS[name].default)
    # Every CUDA module compiles before the first call, so that each test's one call runs the fused kernels that
    # later calls keep (background compiles would leave it the groups' ATen ops); the tests of the background
    # compile switch it back on. EMBER_TEST_BACKGROUND=1 leaves it on for every test: each first call then
    # tests the ATen stand-ins of real graphs instead.
    if os.environ.get("EMBER_TEST_BACKGROUND") != "1":  # a variable of the test harness, not an ember setting
        monkeypatch.setattr(ember.config, "cuda_background", False)
    # TF32 convolutions and matmuls pick algorithms by layout, so eager and any compiled backend differ
    # by ~0.3 in resnet18 input gradients with it on (measured on an H200, inductor too) and by 2e-5
    # with it off. Tests compare backends, not cuDNN's algorithm choices.
    # The compile cache (ember/cache.py) is off, so that each test compiles what it compares; test_compile_cache.py
    # turns it on over a folder of its own. EMBER_TEST_COMPILE_CACHE=1 leaves it on for every test: run twice over
    # one cache folder, the second run's graphs then come from the cache.
    if os.environ.get("EMBER_TEST_COMPILE_CACHE") != "1":  # a variable of the test harness, not an ember setting
        monkeypatch.setattr(ember.config, "compile_cache", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch._dynamo.reset()
    torch.manual_seed(0)

    import ember._C
    import ember.backend

    def counting(original):
        def compile_and_count(graph, config, kind, *args, **kwargs):
            compiled = original(graph, config, kind, *args, **kwargs)
            if isinstance(compiled, ember._C.CompiledGraph):
                helpers.EMBER_GRAPHS.append((kind, compiled))
            return compiled

        return compile_and_count

    for name in ("compile_fx_graph", "compile_cached_graph"):
        monkeypatch.setattr(ember.backend, name, counting(getattr(ember.backend, name)))
    helpers.EMBER_GRAPHS.clear()
    yield
    helpers.EMBER_GRAPHS.clear()
    torch._dynamo.reset()
