"""ember's exception type. Kept in its own module so that raising it never loads the C++ extension."""


class EmberError(RuntimeError):
    """A graph, op, option or package that ember cannot handle. The message names the node or option."""
