"""ember: a torch.compile backend written in C++.

    model = torch.compile(model, backend="ember")

Importing ember is cheap: the C++ extension, AOTAutograd and the decomposition table load on the
first compile, not here.
"""

from .errors import EmberError

__version__ = "0.1.0"
__all__ = ["EmberError", "ember_backend", "explain", "__version__"]


def __getattr__(name):
    if name == "ember_backend":
        from .backend import ember_backend

        return ember_backend
    if name == "explain":
        from .report import explain

        return explain
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
