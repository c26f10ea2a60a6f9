"""recover.core is the one documented public API for a user's own training loop.

Pure (no processes): every name in `recover.core.__all__` resolves, is listed by
`dir(recover.core)` and in the package docstring; `recover/core/__init__.py` imports
nothing heavy at module level (its names load lazily, so `import recover.core` stays
torch-free); and every public call of those names documents itself in Google style:
`Args:` when it takes parameters (beyond self/cls), `Returns:` (or `Yields:` for a
generator) when it returns something, `Raises:` naming the exceptions a loop must
handle where the call raises them.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import recover.core as core

# Per public name: the calls a user's loop makes on it ("" is the function itself;
# a class's constructor is documented on `__init__`). Properties (`done`, `ledger`,
# `leader`, `mesh`) take no arguments and are checked for a docstring only.
PUBLIC_CALLS = {
    "Replica": ["__init__", "from_env", "quota", "fold", "progress", "commit", "stop_run",
                "adopt_committed_count", "close"],
    "RunEnded": ["__init__"],
    "GradientDetached": [],
    "ReplicaContext": ["from_env", "part", "join"],
    "shard_model": [""],
    "ShardedAccumulator": ["__init__", "clip_grad_norm_", "absorb_detached"],
    "ExactAccumulator": ["__init__"],
    "ExactShardedAccumulator": ["__init__"],
    "ExactPipelineAccumulator": ["__init__", "take"],
    "deterministic_kernels": [""],
}
PROPERTIES = {"Replica": ["done", "ledger"], "ReplicaContext": ["leader", "mesh"]}
# The exceptions a loop must handle, and the calls that raise them.
RAISES = {
    ("Replica", "quota"): ["RunEnded"],
    ("Replica", "fold"): ["GradientDetached", "ValueError"],
    ("Replica", "commit"): ["RunEnded", "GradientDetached"],
}


def _calls():
    for name, members in PUBLIC_CALLS.items():
        for member in members:
            yield pytest.param(name, member, id=f"{name}.{member}" if member else name)


def _resolve(name: str, member: str):
    obj = getattr(core, name)
    if not member:
        return obj
    # the member as the class itself defines it (a classmethod unwrapped), not an inherited one
    raw = inspect.getattr_static(obj, member)
    return raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw


def test_every_public_name_resolves_and_is_listed():
    assert set(core.__all__) == set(PUBLIC_CALLS), "PUBLIC_CALLS must cover recover.core.__all__"
    listed = dir(core)
    for name in core.__all__:
        assert getattr(core, name) is not None
        assert name in listed, f"dir(recover.core) leaves out {name}"
        assert f"`{name}`" in core.__doc__, f"recover.core's docstring does not list {name}"
    with pytest.raises(AttributeError):
        core.NoSuchName  # noqa: B018


def test_the_package_imports_nothing_heavy_at_module_level():
    # Without a subprocess, `sys.modules` cannot show what `import recover.core` alone
    # loads (this test's imports loaded torch already); the module-level imports of its
    # source say it: the public names load in `__getattr__`, on first access.
    tree = ast.parse(Path(core.__file__).read_text())
    top = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    top |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    assert top <= {"importlib", "__future__"}, f"recover/core/__init__.py imports {top} at module level"


@pytest.mark.parametrize("name, member", list(_calls()))
def test_each_public_call_documents_its_args_and_returns(name, member):
    fn = _resolve(name, member)
    doc = inspect.getdoc(fn) or ""
    where = f"recover.core.{name}" + (f".{member}" if member else "")
    assert doc, f"{where} has no docstring"
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.name not in ("self", "cls")]
    if params:
        assert "Args:" in doc, f"{where} takes {[p.name for p in params]} but its docstring has no Args:"
        args_section = doc.split("Args:", 1)[1]
        for p in params:
            shown = f"**{p.name}" if p.kind is p.VAR_KEYWORD else p.name
            assert f"{shown}:" in args_section or f"{p.name}:" in args_section, \
                f"{where}'s Args: does not describe {p.name}"
    returns = sig.return_annotation
    if inspect.isgeneratorfunction(fn):
        assert "Yields:" in doc, f"{where} is a generator but its docstring has no Yields:"
    elif member != "__init__" and returns not in (None, "None", inspect.Signature.empty):
        assert "Returns:" in doc, f"{where} returns {returns} but its docstring has no Returns:"
    for exc in RAISES.get((name, member), []):
        assert "Raises:" in doc and exc in doc.split("Raises:", 1)[1], f"{where}'s Raises: does not name {exc}"


@pytest.mark.parametrize("name, prop", [(n, p) for n, ps in PROPERTIES.items() for p in ps])
def test_each_public_property_has_a_docstring(name, prop):
    assert inspect.getdoc(inspect.getattr_static(getattr(core, name), prop)), f"recover.core.{name}.{prop}"


def test_each_returning_call_is_annotated():
    # The Returns: check above reads the annotation; a call without one would pass unchecked.
    for name, members in PUBLIC_CALLS.items():
        for member in members:
            if member == "__init__":
                continue
            fn = _resolve(name, member)
            if not inspect.isgeneratorfunction(fn):
                assert inspect.signature(fn).return_annotation is not inspect.Signature.empty, \
                    f"recover.core.{name}.{member} has no return annotation"
