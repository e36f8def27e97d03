"""Every private RLlib attribute :mod:`agents.ddpg.rllib_internals` reaches still exists on the
installed RLlib's classes (cheap: class attributes, ``__init__`` sources and signatures; no
training run). A failure names the installed RLlib version and the attribute that moved."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

pytest.importorskip("ray.rllib")

from agents.ddpg.rllib_internals import PRIVATE_ATTRIBUTES, RLLIB_VERSION


def _resolve(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _assigned_in_init(cls: type, attr: str) -> bool:
    """Whether ``cls`` or one of its bases assigns ``self.<attr>`` in ``__init__``."""
    pattern = re.compile(rf"self\.{re.escape(attr)}\s*(:[^=\n]*)?=")
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            src = inspect.getsource(init)
        except (OSError, TypeError):
            continue
        if pattern.search(src):
            return True
    return False


@pytest.mark.parametrize("owner, attr, kind", PRIVATE_ATTRIBUTES,
                         ids=[f"{o.rsplit('.', 1)[-1]}.{a}" for o, a, _ in PRIVATE_ATTRIBUTES])
def test_private_rllib_attribute_exists(owner, attr, kind):
    import ray

    obj = _resolve(owner)
    if kind == "class":
        found = hasattr(obj, attr)
    elif kind == "instance":
        found = _assigned_in_init(obj, attr)
    elif kind == "parameter":
        found = attr in inspect.signature(obj).parameters
    else:
        raise AssertionError(f"unknown kind {kind!r} in PRIVATE_ATTRIBUTES")
    assert found, (
        f"RLlib {ray.__version__} has no {kind} attribute {owner}.{attr}; "
        f"agents/ddpg/rllib_internals.py was written against RLlib {RLLIB_VERSION}: update "
        "the function there that reaches it")


def test_overridden_hooks_exist():
    """Every ``@override`` in agents.ddpg names a method its RLlib parent has (RLlib's
    ``override`` checks this at import; importing is the test)."""
    import ray

    try:
        importlib.import_module("agents.ddpg.algorithm")
    except NameError as e:  # raised by ray.rllib.utils.annotations.override
        pytest.fail(f"RLlib {ray.__version__}: {e} (agents/ddpg was written against RLlib "
                    f"{RLLIB_VERSION})")
