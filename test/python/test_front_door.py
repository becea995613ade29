"""The public API as README.md shows it: the names `dir(ember)` and `help(ember)` list, the pattern that catches a
failed compile, and exports without torch's deprecation noise."""

import pydoc
import warnings

import pytest
import torch
import torch._dynamo

import ember

PUBLIC = ("EmberError", "cache", "config", "explain", "export", "load", "wait_for_compiles")


def test_public_names_are_listed_and_documented():
    names = dir(ember)
    for name in PUBLIC:
        assert name in names, name
        assert name in ember.__all__, name
        assert (getattr(ember, name).__doc__ or "").strip(), f"ember.{name} has no docstring"
    text = pydoc.render_doc(ember, renderer=pydoc.plaintext)
    for name in PUBLIC:
        assert name in text, name


def test_export_name_stays_the_function_after_the_submodule_loads(tmp_path):
    model = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    ember.export(model, (x,), tmp_path / "m.ember")
    assert callable(ember.export) and ember.export.__name__ == "export"
    out = ember.load(tmp_path / "m.ember", "cpu").run([x])[0]
    torch.testing.assert_close(out, model(x))


def _catch_ember_error(compiled, *args):
    """The README's pattern: Dynamo wraps the backend's exception, the EmberError is its inner_exception."""
    try:
        compiled(*args)
    except torch._dynamo.exc.BackendCompilerFailed as e:
        if not isinstance(e.inner_exception, ember.EmberError):
            raise
        return e.inner_exception
    return None


def test_unknown_option_is_caught_through_inner_exception():
    compiled = torch.compile(torch.nn.Linear(4, 3), backend="ember", options={"fallback": "raise", "no_such": 1})
    error = _catch_ember_error(compiled, torch.randn(2, 4))
    assert isinstance(error, ember.EmberError)
    assert "no_such" in str(error)


def test_unknown_mode_is_caught_through_inner_exception():
    compiled = torch.compile(torch.nn.Linear(4, 3), backend="ember", mode="max-autotune-no-such")
    error = _catch_ember_error(compiled, torch.randn(2, 4))
    assert isinstance(error, ember.EmberError)


def test_plain_except_ember_error_does_not_catch_it():
    # Why the README shows the longer pattern: BackendCompilerFailed is not an EmberError.
    compiled = torch.compile(torch.nn.Linear(4, 3), backend="ember", options={"no_such": 1})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
        try:
            compiled(torch.randn(2, 4))
        except ember.EmberError:
            pytest.fail("the EmberError arrived unwrapped; the README's pattern can be simplified")


def test_export_prints_no_future_warning(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ember.export(model, (torch.randn(2, 4),), tmp_path / "m.ember")
    future = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert not future, [str(w.message) for w in future]


def test_corrupt_package_is_an_ember_error(tmp_path):
    path = tmp_path / "m.ember"
    ember.export(torch.nn.Linear(4, 3), (torch.randn(2, 4),), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ember.EmberError, match="truncated"):
        ember.load(path, "cpu")
