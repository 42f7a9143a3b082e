"""A torch.compile backend for the tests that tells a compiled run from one that silently ran eagerly.

``P2RStrategy(compile=COUNTED)`` compiles with dynamo's ``aot_eager`` backend (dynamo's graphs through AOTAutograd,
forward and backward, run without generating code: the arithmetic of eager, compiled in seconds rather than the
minute inductor's C++ code generation takes on 2 cores) and counts every call of compiled code. Dynamo falls back to
eager without an error in several cases (under a dispatch mode, past its recompile limit), so a test that compares
losses must also see compiled code run.
"""

import torch
from torch._dynamo import lookup_backend, register_backend

COUNTED = "p2r_counted_aot_eager"
runs = {"compiled": 0}
"""Calls of compiled graphs since the last :func:`fresh`."""


def fresh() -> None:
    """Forget every compiled graph (each run then compiles as a new process would, and none is near dynamo's
    recompile limit) and zero the count."""
    torch._dynamo.reset()
    runs["compiled"] = 0


@register_backend(name=COUNTED)
def _counted_aot_eager(graph: torch.fx.GraphModule, example_inputs: list) -> object:
    compiled = lookup_backend("aot_eager")(graph, example_inputs)

    def run(*args: object) -> object:
        runs["compiled"] += 1
        return compiled(*args)

    run._boxed_call = getattr(compiled, "_boxed_call", False)  # called with one list of inputs, as compiled is
    return run
