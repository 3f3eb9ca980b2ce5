"""A user's own code named in a config: `module:function`, imported from the working directory
or PYTHONPATH (`model.factory`, `data.factory`, `model.loss`). Every way it can fail is one
line naming the path: no such module, a module that fails to import, no such function."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any


def split_path(path: str) -> tuple[str, str]:
    """`package.module:function` as (module, function); a one-line ValueError if malformed."""
    module, sep, function = path.partition(":")
    names = [*module.split("."), *function.split(".")]
    if not sep or not all(name.isidentifier() for name in names):
        raise ValueError(f"{path!r} is not an import path: write module:function (my_models:build)")
    return module, function


def load(path: str) -> Callable:
    """The function `path` names (`module:function`, a dotted attribute after the colon too)."""
    module_name, function = split_path(path)
    # A console script's sys.path starts at its own folder, not the working directory; under
    # `python -m` (every rank) it is there already.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and f"{module_name}.".startswith(f"{e.name}."):  # not one it imports
            raise ValueError(
                f"{path}: no module named {module_name!r} in the working directory "
                f"({os.getcwd()}) or on PYTHONPATH"
            ) from None
        raise ValueError(f"{path}: importing {module_name!r} failed: {_one_line(e)}") from None
    except Exception as e:  # its own error (a syntax error, a failed import inside)
        raise ValueError(f"{path}: importing {module_name!r} failed: {_one_line(e)}") from None
    for attribute in function.split("."):
        if not hasattr(found, attribute):
            raise ValueError(f"{path}: module {module_name!r} has no {function!r}")
        found = getattr(found, attribute)
    if not callable(found):
        raise ValueError(f"{path}: {function!r} is a {type(found).__name__}, not a function")
    return found


def call(path: str, args: dict[str, Any], where: str) -> Any:
    """`path`'s function called with the keyword `args`; arguments it does not take are a
    one-line error naming `where` (the config fields), its own errors its own."""
    function = load(path)
    try:
        inspect.signature(function).bind(**args)
    except TypeError as e:
        raise ValueError(f"{where} {path}: {e} (given {sorted(args)})") from None
    except ValueError:  # (a builtin without a signature: let the call say)
        pass
    return function(**args)


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0]
