"""Your own code: `model.factory`, `data.factory` and `method.loss` as `path/to/file.py:function` or
`package.module:function`. Only the commands that train or predict call these (`trainpipe run`, `tune`, `predict`, the
pipeline's train step); `config validate`, `plan`, `launch` and `pipeline compile` never import them.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from trainpipe.errors import ConfigError

NAMED_LOSSES = ("cross_entropy", "mse", "bce")


def import_object(spec: str, key: str):
    """The function `spec` names (`file.py:function` or `package.module:function`), imported; errors name ``key``."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ConfigError(f"`{key}` must be `path/to/file.py:function` or `package.module:function`, got {spec!r}.")
    try:
        if target.endswith(".py"):
            p = Path(target).expanduser()
            if not p.is_file():
                raise ConfigError(f"`{key}: {spec}` names the file `{target}`, which does not exist. Check the path (in a config file, relative paths are read from the config file's folder).")
            s = importlib.util.spec_from_file_location(f"trainpipe_user_{p.stem}_{abs(hash(str(p.resolve())))}", p)
            module = importlib.util.module_from_spec(s)
            s.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure importing the user's module: say which and why
        raise ConfigError(
            f"`{key}: {spec}`: importing `{target}` failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}). "
            "Fix the module (run `python -c 'import ...'` on it), or give the file path `path/to/file.py:function`."
        ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = ", ".join(sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))[:10]) or "none"
        raise ConfigError(f"`{key}: {spec}`: `{target}` has no function `{name}` (its functions: {found}).")
    return fn


def build_module(spec: str, args: dict):
    """`model.factory(**model.args)`, checked to be an `nn.Module` with parameters."""
    from torch import nn

    fn = import_object(spec, "model.factory")
    try:
        model = fn(**args)
    except TypeError as exc:
        raise ConfigError(f"`model.factory: {spec}` called with `model.args` {args} failed: {exc}. Make `model.args` match the function's parameters.") from None
    except Exception as exc:  # noqa: BLE001 - the user's function raised: name it and why
        raise ConfigError(f"`model.factory: {spec}` raised {type(exc).__name__}: {str(exc)[:200]} when called with `model.args` {args}. Fix the function or the arguments.") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"`model.factory: {spec}` returned a {type(model).__name__}, not a `torch.nn.Module`. Return the module (e.g. `return MyNet(**args)`).")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"`model.factory: {spec}` returned a module with no trainable parameters; there is nothing to train.")
    return model


def build_datasets(spec: str):
    """`data.factory()` -> (train, eval) torch Datasets, checked."""
    fn = import_object(spec, "data.factory")
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"`data.factory: {spec}` raised {type(exc).__name__}: {str(exc)[:200]}. Fix the function.") from None
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(hasattr(d, "__getitem__") and hasattr(d, "__len__") for d in out)):
        raise ConfigError(f"`data.factory: {spec}` returned {type(out).__name__}; it must return `(train, eval)`, two torch `Dataset`s with `__len__` and `__getitem__`.")
    if len(out[0]) < 1 or len(out[1]) < 1:
        raise ConfigError(f"`data.factory: {spec}` returned datasets of {len(out[0])} and {len(out[1])} items; both need at least one.")
    return out[0], out[1]
