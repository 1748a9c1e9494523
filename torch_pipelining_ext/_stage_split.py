# mypy: allow-untyped-defs
"""Split a model into pipeline stages by module names.

Upstream target: a new public module ``torch/distributed/pipelining/stage_split.py``
next to ``stage.py``, exported from ``torch.distributed.pipelining`` (while the
``stage_split`` patch is applied, ``torch.distributed.pipelining.stage_split``
is this module).

Manual pipeline parallelism builds each stage from the whole model by keeping a
few submodules.  This module does that by fully qualified name (FQN), at any
depth, without ever copying what a stage does not keep:

* :func:`build_stage_module` builds one stage model that holds exactly the named
  submodules (and/or parameters and buffers).  The ancestors on the way to a
  kept module are shallow copies of the original containers that hold only the
  kept children, so every kept tensor keeps its original FQN: ``ModuleList``
  indices and ``ModuleDict`` keys are not renumbered, and the stage's
  ``state_dict()`` keys are the original model's keys.  Only the kept subtrees
  are deep-copied (with one memo per stage, so parameters shared between kept
  modules stay shared); on the meta device nothing is allocated.  With
  ``move=True`` the kept modules are moved out of the original model instead of
  being copied.
* :func:`generate_module_names_per_stage` returns the FQN lists for an
  LLM-shaped model (input modules, a container of layers, output modules) as
  the contiguous partition that minimises the most expensive stage.
* :func:`stage_ids_this_rank` maps a pipeline rank to its stage ids for loop-
  and V-style schedules.
* :func:`pipeline_module_split` validates a whole split, builds this rank's
  stage models and wraps them in :class:`~torch.distributed.pipelining.PipelineStage`.

What a stage model looks like
-----------------------------
A module the stage does not keep is removed from its parent: from a
container (``nn.ModuleList``, ``nn.ModuleDict``, ``nn.Sequential``) the entry
is dropped; a removed container becomes an empty container of its class (a
stage without layers still has an empty ``layers``); anything else is set to
``None``.  Parameters and
persistent buffers of an ancestor that the stage does not name are set to
``None`` (so a parameter registered on the root is not copied into every
stage); non-persistent buffers of ancestors (derived state such as rotary
tables) are replicated into every stage.  A forward that tolerates removed
modules therefore looks like this::

    def forward(self, h):
        h = call_if_present(self.tok_embeddings, h)  # tokens -> hidden on stage 0
        for layer in self.layers:  # only this stage's layers
            h = layer(h)
        h = call_if_present(self.norm, h)
        return call_if_present(self.output, h)

Iterate over the layers (``for layer in self.layers``, or
``self.layers.values()`` for an ``nn.ModuleDict``) rather than indexing them:
a stage holding layers 4 and 5 keeps the keys ``"4"`` and ``"5"``, and
``self.layers[0]`` does not exist there.  Attributes that are not modules or
tensors (a process group, a device mesh, a config) are copied with the kept
modules, except those that cannot be copied, which the stage shares with the
model (``[Note: what a stage shares with the model]``).
"""

from __future__ import annotations

import copy
import difflib
import functools
import inspect
import logging
import math
import pickle
import types
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TYPE_CHECKING

import torch
import torch.nn as nn


if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage


__all__ = [
    "build_stage_module",
    "build_stage_modules",
    "call_if_present",
    "generate_module_names_per_stage",
    "pipeline_group",
    "pipeline_module_split",
    "resolve_schedule_class",
    "stage_ids_this_rank",
]

logger = logging.getLogger(__name__)

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


# ---------------------------------------------------------------------------
# Forward helper
# ---------------------------------------------------------------------------


def call_if_present(
    module: Callable[..., Any] | None, x: Any, *args: Any, **kwargs: Any
) -> Any:
    """Call ``module(x, *args, **kwargs)``, or return ``x`` unchanged when the
    stage split removed ``module`` (it is ``None`` in the stage model).

    This is the pattern for a forward that runs both on the whole model and on
    any stage built by :func:`build_stage_module`: the first stage turns tokens into
    hidden states, later stages receive hidden states and skip the embedding,
    only the last stage applies the head.

    Example::

        h = call_if_present(self.tok_embeddings, tokens)
    """
    if module is None:
        return x
    return module(x, *args, **kwargs)


# ---------------------------------------------------------------------------
# Name resolution and validation
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Item:
    """One resolved name of a stage: a submodule, or a parameter/buffer."""

    fqn: str
    parts: tuple[str, ...]
    kind: str  # "module", "parameter" or "buffer"
    # A module owning no parameters and no persistent buffers (e.g. a rotary
    # embedding) may be listed by several stages; each gets its own copy.
    replicable: bool


def _owns_state(module: nn.Module) -> bool:
    """Whether ``module`` (or a descendant) holds a parameter or persistent buffer."""
    for m in module.modules():
        if any(p is not None for p in m._parameters.values()):
            return True
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                return True
    return False


def _all_names(model: nn.Module) -> list[str]:
    names = [n for n, _ in model.named_modules(remove_duplicate=False) if n]
    names += [n for n, _ in model.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    return names


def _describe_keys(keys: Sequence[str]) -> str:
    if not keys:
        return "no children"
    if all(k.isdigit() for k in keys):
        ints = sorted(int(k) for k in keys)
        if ints == list(range(ints[0], ints[-1] + 1)):
            return f"entries {ints[0]}..{ints[-1]}"
        return f"entries {ints}"
    shown = ", ".join(repr(k) for k in keys[:12])
    return f"children {shown}" + (", ..." if len(keys) > 12 else "")


def _unknown_name_error(
    model: nn.Module, fqn: str, parts: Sequence[str], depth: int, at: nn.Module
) -> ValueError:
    prefix = ".".join(parts[:depth])
    where = (
        f"{prefix!r} ({type(at).__name__})"
        if prefix
        else f"the model ({type(model).__name__})"
    )
    msg = f"{fqn!r} names no submodule, parameter or buffer of {type(model).__name__}"
    if at._modules.get(parts[depth], 0) is None:
        removed = ".".join(parts[: depth + 1])
        msg += (
            f": {removed!r} was removed from the model (moved into a stage by "
            "move=True?)"
        )
    else:
        child_keys = [k for k, v in at._modules.items() if v is not None]
        msg += f": {where} has {_describe_keys(child_keys)}"
    close = difflib.get_close_matches(fqn, _all_names(model), n=3, cutoff=0.6)
    if close:
        msg += f"; did you mean {' or '.join(repr(c) for c in close)}?"
    return ValueError(msg)


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be an nn.Module, got {type(model).__name__} {model!r}"
        )


def _resolve(model: nn.Module, fqn: Any) -> _Item:
    """Find the object named ``fqn`` by walking the module tree along the name
    (cost proportional to the depth of the name, not to the model)."""
    if not isinstance(fqn, str):
        raise TypeError(
            f"module names must be strings, got {type(fqn).__name__} {fqn!r}"
        )
    if fqn == "":
        raise ValueError(
            "the empty name means the whole model; a stage must name parts of it"
        )
    parts = tuple(fqn.split("."))
    mod = model
    for depth, part in enumerate(parts):
        child = mod._modules.get(part)
        if child is not None:
            mod = child
            continue
        if depth == len(parts) - 1:
            if mod._parameters.get(part) is not None:
                return _Item(fqn, parts, "parameter", False)
            if mod._buffers.get(part) is not None:
                return _Item(fqn, parts, "buffer", False)
        raise _unknown_name_error(model, fqn, parts, depth, mod)
    return _Item(fqn, parts, "module", not _owns_state(mod))


def _resolve_stage(model: nn.Module, module_names: Any, stage_desc: str) -> list[_Item]:
    """Resolve and normalise the names of one stage.

    A name nested inside another name of the same stage is redundant and
    dropped; a repeated name is dropped.
    """
    if isinstance(module_names, (str, bytes)) or not isinstance(module_names, Iterable):
        raise TypeError(
            f"{stage_desc}: module names must be a sequence of strings, got "
            f"{type(module_names).__name__} {module_names!r}"
            + (
                f" (did you mean [{module_names!r}]?)"
                if isinstance(module_names, str)
                else ""
            )
        )
    names = list(module_names)
    if not names:
        raise ValueError(
            f"{stage_desc} is empty: every stage must name at least one module"
        )
    items = [_resolve(model, n) for n in names]
    module_paths = {it.parts for it in items if it.kind == "module"}
    kept: list[_Item] = []
    seen: set[tuple[str, ...]] = set()
    for it in items:
        if it.parts in seen:
            continue
        seen.add(it.parts)
        # Redundant when a strict ancestor module is also kept by this stage.
        if any(it.parts[:i] in module_paths for i in range(1, len(it.parts))):
            continue
        kept.append(it)
    return kept


def _validate_split(
    model: nn.Module,
    items_per_stage: Sequence[Sequence[_Item]],
    allow_uncovered: bool,
) -> None:
    """Cross-stage checks: overlaps, uncovered state, ties across stages."""
    # Every kept path -> (stage, item).
    owners: dict[tuple[str, ...], list[tuple[int, _Item]]] = defaultdict(list)
    for s, items in enumerate(items_per_stage):
        for it in items:
            owners[it.parts].append((s, it))
    _check_disjoint(owners)
    _check_coverage(model, owners, allow_uncovered)


def _check_disjoint(owners: dict[tuple[str, ...], list[tuple[int, _Item]]]) -> None:
    """No stateful module in two stages, none in a module another stage keeps whole."""
    for parts, entries in owners.items():
        stages = sorted({s for s, _ in entries})
        if len(stages) > 1 and not entries[0][1].replicable:
            raise ValueError(
                f"{entries[0][1].fqn!r} is listed in stages {stages}; a module that "
                "owns parameters or persistent buffers must belong to exactly one "
                "stage (only parameter-free modules, such as a rotary embedding, may "
                "be replicated)"
            )
    for parts, entries in owners.items():
        for i in range(1, len(parts)):
            for s_out, it_out in owners.get(parts[:i], ()):
                for s_in, it_in in entries:
                    if s_out != s_in and not it_out.replicable:
                        raise ValueError(
                            f"{it_in.fqn!r} (stage {s_in}) is inside {it_out.fqn!r}, "
                            f"which stage {s_out} keeps whole; a module can belong to "
                            "only one stage"
                        )


def _state_aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every parameter and persistent buffer of ``model`` (by identity) -> its FQNs."""
    aliases: dict[int, list[str]] = defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases[id(p)].append(name)
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for b_name, b in mod._buffers.items():
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                aliases[id(b)].append(f"{mod_name}.{b_name}" if mod_name else b_name)
    return aliases


def _check_coverage(
    model: nn.Module,
    owners: dict[tuple[str, ...], list[tuple[int, _Item]]],
    allow_uncovered: bool,
) -> None:
    """Every tensor in some stage (unless ``allow_uncovered``).

    Warns for each tensor tied across stages.
    """

    def covering_stages(fqn: str) -> set[int]:
        parts = tuple(fqn.split("."))
        return {
            s for i in range(1, len(parts) + 1) for s, _ in owners.get(parts[:i], ())
        }

    uncovered: list[str] = []
    for names in _state_aliases(model).values():
        stage_sets = {n: covering_stages(n) for n in names}
        all_stages = set().union(*stage_sets.values())
        if not all_stages:
            uncovered.extend(names)
        elif len(all_stages) > 1:
            where = ", ".join(
                f"{n!r} (stage {sorted(st)})" if st else f"{n!r} (no stage)"
                for n, st in stage_sets.items()
            )
            warnings.warn(
                f"a tensor is shared across pipeline stages {sorted(all_stages)}: "
                f"{where}. The split does not keep this tie (each stage holds its own "
                "copy; with move=True, stages built in one process hold the same "
                "object): keep the tied modules in one stage, untie them, or reduce "
                "their gradients across the stages yourself",
                UserWarning,
                stacklevel=4,
            )
    if uncovered and not allow_uncovered:
        shown = ", ".join(repr(n) for n in uncovered[:10])
        more = f" and {len(uncovered) - 10} more" if len(uncovered) > 10 else ""
        raise ValueError(
            f"{len(uncovered)} parameters/persistent buffers belong to no stage: "
            f"{shown}{more}. List their modules (or the tensors themselves) in a "
            "stage, or pass allow_uncovered=True to drop them"
        )


# ---------------------------------------------------------------------------
# Building a stage
# ---------------------------------------------------------------------------


def _join(path: tuple[str, ...], key: str) -> str:
    return ".".join((*path, key))


def _shallow_module_copy(orig: nn.Module) -> nn.Module:
    """A new instance of ``type(orig)`` sharing its plain attributes, with its
    own (empty) parameter/buffer/module dicts and its own hook dicts."""
    new = copy.copy(orig)
    d = new.__dict__
    fresh = {
        name: type(getattr(orig, name))()
        for name in ("_parameters", "_buffers", "_modules")
    }
    for key, value in d.items():
        # hook tables, _non_persistent_buffers_set, ...: the stage gets its own
        if key not in fresh and isinstance(value, (dict, set, list)):
            d[key] = copy.copy(value)
    d.update(fresh)
    return new


# [Note: what a stage shares with the model]
# Copying a kept module deep-copies its tensors and plain Python state, but a
# module often also holds handles: a process group (``self.ep_group =
# group``), a device mesh, a lock, a stream.  A handle cannot be copied
# (``deepcopy`` of a ``ProcessGroup`` raises "cannot pickle") or must not be
# (a copied ``DeviceMesh`` is another object than the one DTensors compare
# with), and the stage needs the very same one anyway.  So before a kept
# module is copied, its attributes are walked (through lists, tuples, sets,
# dicts and plain objects, at any depth):
#
# * process groups and device meshes are entered into the copy's memo as
#   themselves, so every reference to them in the copy is the original;
# * every other object is copied on its own, innermost first; one that
#   cannot be copied is shared the same way, unless it refers to a tensor or
#   a module: sharing it would tie the stage to the original model, so the
#   split raises a ``TypeError`` naming the attribute's full name and what
#   to do instead (a ``__deepcopy__`` on its class, the state kept
#   elsewhere, or ``move=True``, which copies nothing).
#
# A copy that fails halfway leaves no entry in the memo, and everything else
# is copied exactly as ``copy.deepcopy`` of the module copies it.

# what deepcopy raises for an object that cannot be copied at all ("cannot
# pickle", no __reduce__); not RuntimeError, which is an error of the object
# being copied (a non-leaf tensor, a failing __deepcopy__): it propagates
# rather than the object being shared
_COPY_ERRORS = (
    TypeError,
    AttributeError,
    NotImplementedError,
    copy.Error,
    pickle.PickleError,
)

# values deepcopy returns as they are, and tensors (copied by deepcopy itself)
_NOT_WALKED = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type,
    range,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.CodeType,
    weakref.ref,
    torch.dtype,
    torch.device,
    torch.Tensor,
)

# a module's own tables of tensors: deepcopy copies what they hold
_TENSOR_TABLES = frozenset({"_parameters", "_buffers"})


@functools.cache
def _handle_types() -> tuple[type, ...]:
    """Types a stage always shares with the model (see [Note: what a stage
    shares with the model])."""
    import torch.distributed as dist

    if not dist.is_available():
        return ()
    from torch.distributed.device_mesh import DeviceMesh

    return (dist.ProcessGroup, DeviceMesh)


def _members(value: Any, name: str) -> Iterable[tuple[str, Any]]:
    """The objects ``value`` refers to, with their full names, as
    ``copy.deepcopy`` reaches them (a module's tensors aside)."""
    if isinstance(value, nn.Module):
        for key, child in value._modules.items():
            yield f"{name}.{key}", child
        for key, attr in vars(value).items():
            if key != "_modules" and key not in _TENSOR_TABLES:
                yield f"{name}.{key}", attr
    elif isinstance(value, dict):
        for key, item in value.items():
            yield f"{name}[{key!r}]", item
    elif isinstance(value, (list, tuple, set, frozenset)):
        for i, item in enumerate(value):
            yield f"{name}[{i}]", item
    elif isinstance(value, types.MethodType):
        yield f"{name}.__self__", value.__self__
    elif isinstance(getattr(value, "__dict__", None), dict):
        for key, attr in vars(value).items():
            yield f"{name}.{key}", attr


def _objects_to_copy(
    value: Any, name: str, memo: dict[int, Any]
) -> list[tuple[str, Any]]:
    """Enter the handles reachable from ``value`` into ``memo`` as
    themselves; return the other objects that are neither containers nor
    modules: first those that refer to nothing, then the others, innermost
    first (so that a handle of an unknown type is shared before an object
    that refers to it is copied)."""
    leaves: list[tuple[str, Any]] = []
    others: list[tuple[str, Any]] = []
    seen: set[int] = set()
    stack = [(name, value, False)]
    while stack:
        name, value, done = stack.pop()
        if done:
            others.append((name, value))
            continue
        if isinstance(value, _NOT_WALKED) or id(value) in memo or id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, _handle_types()):
            memo[id(value)] = value
            continue
        members = list(_members(value, name))
        if not isinstance(value, (nn.Module, dict, list, tuple, set, frozenset)):
            if members:
                stack.append((name, value, True))  # after what it refers to
            else:
                leaves.append((name, value))
        stack.extend((n, v, False) for n, v in reversed(members))
    return leaves + others


def _model_state_inside(value: Any, name: str) -> str | None:
    """The full name of a tensor or module ``value`` refers to, if any."""
    seen: set[int] = set()
    stack = list(_members(value, name))
    while stack:
        name, item = stack.pop()
        if isinstance(item, (torch.Tensor, nn.Module)):
            return name
        if isinstance(item, _NOT_WALKED) or id(item) in seen:
            continue
        seen.add(id(item))
        stack.extend(_members(item, name))
    return None


def _copy_or_share(value: Any, name: str, memo: dict[int, Any]) -> None:
    """Copy ``value`` into ``memo``, or share it when it cannot be copied."""
    before = len(memo)
    try:
        copy.deepcopy(value, memo)
        return
    except _COPY_ERRORS as e:
        error = e
    for key in list(memo)[before:]:  # the entries of the failed copy
        del memo[key]
    inner = _model_state_inside(value, name)
    if inner is not None:
        raise TypeError(
            f"cannot build the stage: {name!r} ({type(value).__name__}) cannot be "
            f"copied ({type(error).__name__}: {error}), and it cannot be shared "
            f"with the model either, since it refers to {inner!r}. Give "
            f"{type(value).__name__} a __deepcopy__ (returning self shares it), keep "
            "that state out of the object, or pass move=True (the stage then takes "
            "the model's modules instead of copies)"
        ) from error
    memo[id(value)] = value
    logger.debug(
        "stage split: %s (%s) cannot be copied (%s); the stage shares it",
        name,
        type(value).__name__,
        error,
    )


def _copy_kept(obj: Any, fqn: str, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy(obj, memo)``, sharing what cannot be copied (see
    [Note: what a stage shares with the model])."""
    for name, value in _objects_to_copy(obj, fqn, memo):
        _copy_or_share(value, name, memo)
    try:
        return copy.deepcopy(obj, memo)
    except _COPY_ERRORS as e:
        raise TypeError(
            f"cannot build the stage: copying {fqn!r} ({type(obj).__name__}) "
            f"failed ({type(e).__name__}: {e}). Give its class a __deepcopy__, or "
            "pass move=True (the stage then takes the model's modules instead of "
            "copies)"
        ) from e


def _build_stage(model: nn.Module, items: Sequence[_Item], move: bool) -> nn.Module:
    whole = {it.parts: it for it in items if it.kind == "module"}
    tensor_keep: dict[tuple[str, ...], set[str]] = defaultdict(set)
    for it in items:
        if it.kind != "module":
            tensor_keep[it.parts[:-1]].add(it.parts[-1])
    on_path: dict[tuple[str, ...], set[str]] = defaultdict(set)
    for it in items:
        for i in range(len(it.parts)):
            on_path[it.parts[:i]].add(it.parts[i])

    # One memo per stage: tensors and modules shared by kept subtrees stay
    # shared, and references to ancestors resolve to their skeleton copies.
    memo: dict[int, Any] = {}
    moved: list[tuple[nn.Module, str, str]] = []  # (owner, dict name, key)

    def take(obj: Any, owner: nn.Module, where: str, fqn: str, replicate: bool) -> Any:
        key = fqn.rpartition(".")[2]
        if move and not replicate:
            moved.append((owner, where, key))
            return obj
        return _copy_kept(obj, fqn, memo)

    def build(path: tuple[str, ...], orig: nn.Module) -> nn.Module:
        new = _shallow_module_copy(orig)
        memo[id(orig)] = new
        keep_children = on_path.get(path, set())
        keep_tensors = tensor_keep.get(path, set())
        is_container = isinstance(orig, _CONTAINERS)
        for key, child in orig._modules.items():
            if key in keep_children and child is not None:
                child_path = path + (key,)
                it = whole.get(child_path)
                if it is not None:
                    new._modules[key] = take(
                        child, orig, "_modules", it.fqn, it.replicable
                    )
                else:
                    new._modules[key] = build(child_path, child)
            elif is_container:
                continue  # dropped: the kept entries keep their keys
            elif isinstance(child, _CONTAINERS):
                # an empty container: `for layer in self.layers` runs nothing
                new._modules[key] = _shallow_module_copy(child)
            else:
                new._modules[key] = None
        for key, p in orig._parameters.items():
            kept = key in keep_tensors and p is not None
            new._parameters[key] = (
                take(p, orig, "_parameters", _join(path, key), False) if kept else None
            )
        for key, b in orig._buffers.items():
            if b is None:
                new._buffers[key] = None
            elif key in keep_tensors:
                new._buffers[key] = take(b, orig, "_buffers", _join(path, key), False)
            elif key in orig._non_persistent_buffers_set:
                # Derived state (e.g. rotary tables) every stage may need.
                new._buffers[key] = b if move else copy.deepcopy(b, memo)
            else:
                new._buffers[key] = None
        return new

    stage = build((), model)
    # Only now that the stage is complete, detach what it took from the original.
    for owner, where, key in moved:
        table = getattr(owner, where)
        if where == "_modules" and isinstance(owner, _CONTAINERS):
            del table[key]  # not ModuleList.__delitem__, which renumbers
        else:
            table[key] = None
    return stage


def build_stage_module(
    model: nn.Module, module_names: Sequence[str], *, move: bool = False
) -> nn.Module:
    """Build a stage model that holds exactly the named parts of ``model``.

    Args:
        model: the whole model (on any device, including ``meta``).
        module_names: FQNs of the submodules the stage keeps, at any depth
            (``"layers.3"``, ``"model.layers.3"``, ``"model.embed_tokens"``,
            ``"lm_head"``); a name may also be a parameter or buffer
            (``"pos_embed"``).  A named module is kept whole.
        move: move the kept modules and tensors out of ``model`` instead of
            copying them; afterwards ``model`` no longer holds them (they are
            ``None`` there, or dropped from their container).  Parameter-free
            modules named by several stages are still copied.

    Returns:
        A module of the same class as ``model`` holding only the named parts,
        under their original FQNs.  What it does not keep is gone: a removed
        entry of an ``nn.ModuleList`` / ``nn.ModuleDict`` / ``nn.Sequential``
        is dropped (the others keep their keys), a removed container is an
        empty one, any other removed module or parameter is ``None``; so its
        forward must skip what is ``None`` (:func:`call_if_present`) and
        iterate over its layers instead of indexing them (see "What a stage
        model looks like" in the module docstring).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``module_names`` is a
            string or holds non-strings; or a kept module holds an object
            that can be neither copied nor shared (it refers to tensors or
            modules; the message names it and what to do).
        ValueError: ``module_names`` is empty or names something that does not
            exist (the message suggests close matches).

    The cost is proportional to what the stage keeps: only the kept subtrees
    are deep-copied, the containers above them are shallow copies.  Parameters
    shared by kept modules stay shared in the stage.  Process groups, device
    meshes and other attributes that cannot be copied are shared with the
    model (see ``[Note: what a stage shares with the model]``).  Checks that
    need every stage (overlaps, state kept by no stage, tensors tied across
    stages) are made by :func:`pipeline_module_split`.
    """
    _check_model(model)
    items = _resolve_stage(model, module_names, "module_names")
    return _build_stage(model, items, move)


def build_stage_modules(
    model: nn.Module,
    module_names_per_stage: Sequence[Sequence[str]],
    stage_ids: Sequence[int],
    *,
    move: bool = False,
    allow_uncovered: bool = False,
) -> list[nn.Module]:
    """Validate the whole split of ``model`` and build the stage models ``stage_ids``.

    The checks are :func:`pipeline_module_split`'s (every name exists; no
    module in two stages, except parameter-free ones; none inside a module of
    another stage; every parameter and persistent buffer in some stage unless
    ``allow_uncovered``; tensors tied across stages are reported with a
    warning); nothing is built when one fails.  Each stage is then built as
    :func:`build_stage_module` builds it.

    Args:
        model: the whole model.
        module_names_per_stage: one sequence of FQNs per stage.
        stage_ids: the stages to build, e.g. from :func:`stage_ids_this_rank`.
        move: move the kept modules out of ``model`` instead of copying them.
        allow_uncovered: allow parameters/buffers that no stage keeps.

    Returns:
        The stage models, in the order of ``stage_ids``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or the names are not
            sequences of strings.
        ValueError: a check above fails, or a stage id is out of range.
    """
    _check_model(model)
    if isinstance(module_names_per_stage, (str, bytes)) or not isinstance(
        module_names_per_stage, Sequence
    ):
        raise TypeError(
            "module_names_per_stage must be a sequence with one sequence of FQNs per "
            f"stage, got {type(module_names_per_stage).__name__}"
        )
    if not module_names_per_stage:
        raise ValueError(
            "module_names_per_stage is empty: a pipeline needs at least one stage"
        )
    items = [
        _resolve_stage(model, names, f"stage {s}")
        for s, names in enumerate(module_names_per_stage)
    ]
    for s in stage_ids:
        if not 0 <= s < len(items):
            raise ValueError(f"stage id {s} out of range for {len(items)} stages")
    _validate_split(model, items, allow_uncovered)
    return [_build_stage(model, items[s], move) for s in stage_ids]


# ---------------------------------------------------------------------------
# Partition generator
# ---------------------------------------------------------------------------


def _check_names(arg: str, value: Any) -> list[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{arg} must be a sequence of module names, got {type(value).__name__} "
            f"{value!r}"
        )
    names = list(value)
    for n in names:
        if not isinstance(n, str) or not n:
            raise TypeError(f"{arg} must hold non-empty strings, got {n!r}")
    return names


def _check_no_shared_module(named: Sequence[tuple[str, str]]) -> None:
    """Raise if two entries of ``named`` (``(argument, fqn)`` pairs) are the
    same module or one lies inside the other: the stage lists would then share
    it, and :func:`build_stage_module` would copy it into two stages."""
    by_parts = [(arg, name, tuple(name.split("."))) for arg, name in named]
    for i, (arg_a, a, pa) in enumerate(by_parts):
        for arg_b, b, pb in by_parts[i + 1 :]:
            short, long = (pa, pb) if len(pa) <= len(pb) else (pb, pa)
            if long[: len(short)] != short:
                continue
            where = f"{a!r} ({arg_a}) and {b!r} ({arg_b})"
            relation = (
                "name the same module"
                if pa == pb
                else "overlap (one module contains the other)"
            )
            raise ValueError(
                f"{where} {relation}: every module must belong to one place in the "
                "pipeline (input modules, one layer, output modules, or replicated "
                "parameter-free modules)"
            )


def _check_cost(arg: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{arg} must be a finite number >= 0, got {value!r}")
    return float(value)


def _min_max_partition(costs: Sequence[float], num_parts: int) -> list[int]:
    """Split ``costs`` into ``num_parts`` non-empty contiguous groups.

    Minimises the most expensive group; among those partitions, minimises the
    sum of squared group costs (the most even one); remaining ties go to the
    partition whose group costs, read from the first group, are smallest
    (then to the one with fewer units in earlier groups).  Returns the
    ``num_parts + 1`` boundaries.
    """
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def seg(i: int, j: int) -> float:
        return prefix[j] - prefix[i]

    inf = math.inf
    # best[k][j]: minimal max cost of the first j units in k groups.
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        prev, cur = best[k - 1], best[k]
        for j in range(k, n - (num_parts - k) + 1):
            v = inf
            for i in range(k - 1, j):
                m = prev[i]
                s = seg(i, j)
                if s > m:
                    m = s
                if m < v:
                    v = m
            cur[j] = v
    bound = best[num_parts][n]

    # sq[k][i]: minimal sum of squared costs of units i..n-1 in k groups, each <= bound.
    sq = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    nxt = [[-1] * (n + 1) for _ in range(num_parts + 1)]
    sq[0][n] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(n - k, (num_parts - k) - 1, -1):
            v, arg, arg_cost = inf, -1, inf
            for j in range(i + 1, n - (k - 1) + 1):
                s = seg(i, j)
                if s > bound:
                    break
                rest = sq[k - 1][j]
                if rest == inf:
                    continue
                total = s * s + rest
                if total < v or (total == v and s < arg_cost):
                    v, arg, arg_cost = total, j, s
            sq[k][i], nxt[k][i] = v, arg
    bounds = [0]
    i = 0
    for k in range(num_parts, 0, -1):
        i = nxt[k][i]
        if i < 0:  # pragma: no cover - the first pass guarantees feasibility
            raise AssertionError(
                "internal error: no partition within the optimal bound"
            )
        bounds.append(i)
    return bounds


def _check_count(arg: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{arg} must be an int >= {minimum}, got {value!r}")
    return value


def _layer_costs(num_layers: int, layer_costs: Sequence[float] | None) -> list[float]:
    if layer_costs is None:
        return [1.0] * num_layers
    costs = [_check_cost(f"layer_costs[{i}]", c) for i, c in enumerate(layer_costs)]
    if len(costs) != num_layers:
        raise ValueError(
            f"layer_costs has {len(costs)} entries for {num_layers} layers"
        )
    return costs


def _partition_units(
    num_stages: int,
    num_layers: int,
    costs: tuple[float, float, Sequence[float] | None],
    layers_prefix: str,
    modules: tuple[Sequence[str], Sequence[str], Sequence[str]],
) -> tuple[list[tuple[float, list[str]]], list[str]]:
    """The checked units a partition is made of, and the replicated modules.

    A unit is (cost, FQNs): the input modules, each layer, the output modules.
    ``costs`` is (input weight, output weight, layer costs), ``modules`` is
    (input, output, replicated modules).
    """
    _check_count("num_stages", num_stages, 1)
    _check_count("num_layers", num_layers, 0)
    in_cost = _check_cost("input_weight", costs[0])
    out_cost = _check_cost("output_weight", costs[1])
    layer_costs = _layer_costs(num_layers, costs[2])
    if not isinstance(layers_prefix, str) or not layers_prefix:
        raise TypeError(
            f"layers_prefix must be a non-empty string, got {layers_prefix!r}"
        )
    inputs, outputs, replicated = (
        _check_names(arg, names)
        for arg, names in zip(
            ("input_modules", "output_modules", "replicated_modules"), modules
        )
    )
    _check_no_shared_module(
        [("input_modules", n) for n in inputs]
        + [("output_modules", n) for n in outputs]
        + [("replicated_modules", n) for n in replicated]
        # the layers themselves are distinct and disjoint; their container
        # stands for all of them in the overlap check
        + [(f"the layers {layers_prefix}.0..{num_layers - 1}", layers_prefix)]
        * (num_layers > 0)
    )
    units = [(in_cost, inputs)] if inputs else []
    units += [(c, [f"{layers_prefix}.{i}"]) for i, c in enumerate(layer_costs)]
    units += [(out_cost, outputs)] if outputs else []
    if num_stages > len(units):
        raise ValueError(
            f"cannot make {num_stages} non-empty stages from {num_layers} layers"
            + (" plus the input modules" if inputs else "")
            + (" plus the output modules" if outputs else "")
            + f": at most {len(units)} stages"
        )
    return units, replicated


def generate_module_names_per_stage(
    num_stages: int,
    num_layers: int,
    *,
    input_weight: float = 1,
    output_weight: float = 1,
    layer_costs: Sequence[float] | None = None,
    layers_prefix: str = "layers",
    input_modules: Sequence[str] = ("tok_embeddings",),
    output_modules: Sequence[str] = ("norm", "output"),
    replicated_modules: Sequence[str] = (),
) -> list[list[str]]:
    """FQN lists per stage for an LLM-shaped model.

    The model is read as a sequence of units: the input modules (cost
    ``input_weight``, i.e. counted as that many layers), the layers
    ``f"{layers_prefix}.{i}"`` (cost ``layer_costs[i]``, default 1 each) and
    the output modules (cost ``output_weight``).  The result is the contiguous
    partition of that sequence into ``num_stages`` non-empty stages that
    minimises the cost of the most expensive stage (exact, by dynamic
    programming); among optimal partitions the most even one is returned
    (smallest sum of squared stage costs), then the one with the cheapest
    earlier stages.  The result is deterministic.

    Args:
        num_stages: number of pipeline stages (all ranks together).
        num_layers: number of layers in the ``layers_prefix`` container.
        input_weight: cost of the input modules, in layers.
        output_weight: cost of the output modules, in layers.
        layer_costs: per-layer costs (e.g. MoE layers dearer than dense ones);
            ``num_layers`` non-negative numbers.
        layers_prefix: FQN of the layer container, e.g. ``"model.layers"``.
        input_modules: modules of the first stage before the layers, e.g.
            ``["model.embed_tokens"]``; empty for none.
        output_modules: modules of the last stage after the layers, e.g.
            ``["model.norm", "lm_head"]``; empty for none.
        replicated_modules: parameter-free modules every stage needs (e.g.
            ``["model.rotary_emb"]``), appended to every stage.

    Returns:
        ``num_stages`` lists of FQNs, in stage order.

    Raises:
        ValueError: fewer units (input modules, layers, output modules) than
            stages, invalid counts/costs, or a module named twice (as input
            and output module, as a layer and a replicated module, ...) or
            inside another named module.

    Example::

        >>> generate_module_names_per_stage(2, 4)  # doctest: +NORMALIZE_WHITESPACE
        [['tok_embeddings', 'layers.0', 'layers.1'],
         ['layers.2', 'layers.3', 'norm', 'output']]
    """
    units, replicated = _partition_units(
        num_stages,
        num_layers,
        (input_weight, output_weight, layer_costs),
        layers_prefix,
        (input_modules, output_modules, replicated_modules),
    )
    bounds = _min_max_partition([c for c, _ in units], num_stages)
    result = []
    for s in range(num_stages):
        names = [
            n for _, unit_names in units[bounds[s] : bounds[s + 1]] for n in unit_names
        ]
        result.append(names + [n for n in replicated if n not in names])
    return result


# ---------------------------------------------------------------------------
# Stage placement
# ---------------------------------------------------------------------------


def resolve_schedule_class(schedule: type | str) -> type:
    """The pipeline schedule class ``schedule`` names.

    Args:
        schedule: a schedule class, or its name with or without the
            ``Schedule`` prefix (``"Interleaved1F1B"``, ``"ScheduleDualPipeV"``).

    Raises:
        TypeError: ``schedule`` is a class that is not a pipeline schedule, or
            neither a class nor a string.
        ValueError: no schedule has that name.
    """
    from torch.distributed.pipelining import schedules

    if isinstance(schedule, type):
        if not issubclass(schedule, schedules._PipelineSchedule):
            raise TypeError(
                f"{schedule.__name__} is not a pipeline schedule class; pass a "
                "schedule class such as ScheduleInterleaved1F1B, its name, or 'loop' "
                "/ 'v'"
            )
        return schedule
    if isinstance(schedule, str):
        name = schedule
        if name.lower().startswith("schedule"):
            name = name[len("schedule") :]
        try:
            return schedules.get_schedule_class(name)
        except ValueError as e:
            raise ValueError(f"unknown pipeline schedule {schedule!r}: {e}") from None
    raise TypeError(
        f"schedule must be a schedule class or name, got {type(schedule).__name__} "
        f"{schedule!r}"
    )


def _is_v_schedule(cls: type) -> bool:
    from torch.distributed.pipelining import schedules

    v_classes = tuple(
        getattr(schedules, n)
        for n in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
        if hasattr(schedules, n)
    )
    return issubclass(cls, v_classes)


def _style(style: Any) -> str:
    if isinstance(style, str) and style in ("loop", "v"):
        return style
    if style is None:
        return "loop"
    return "v" if _is_v_schedule(resolve_schedule_class(style)) else "loop"


def _v_stage_count_error(style: str | type, pp_size: int, num_stages: int) -> str:
    """The wrong stage count of a V-style schedule, in plain words."""
    if style == "v":
        name = "a V-style schedule"
    else:
        name = style if isinstance(style, str) else style.__name__
    ranks = (
        "1 pipeline rank needs" if pp_size == 1 else f"{pp_size} pipeline ranks need"
    )
    return (
        f"{name} runs exactly 2 stages on each pipeline rank (rank r runs stages r "
        f"and {2 * pp_size - 1} - r, a V), so {ranks} {2 * pp_size} stages, "
        f"but {num_stages} were given: make the stage names for {2 * pp_size} "
        f"stages, e.g. generate_module_names_per_stage({2 * pp_size}, num_layers)"
    )


def stage_ids_this_rank(
    pp_rank: int, pp_size: int, num_stages: int, style: str | type = "loop"
) -> tuple[int, ...]:
    """The stage ids a pipeline rank runs.

    Args:
        pp_rank: rank in the pipeline group.
        pp_size: size of the pipeline group.
        num_stages: number of stages of the whole pipeline; a multiple of
            ``pp_size``.
        style: ``"loop"`` (stages ``pp_rank, pp_rank + pp_size, ...``), ``"v"``
            (stages ``pp_rank`` and ``num_stages - 1 - pp_rank``, exactly two
            per rank), or a schedule class or name to infer it from
            (``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` are V-style,
            every other schedule loop-style).

    Raises:
        TypeError: ``style`` is a class that is not a pipeline schedule.
        ValueError: ``num_stages`` not divisible by ``pp_size``, a rank out of
            range, an unknown style or schedule name, or a V-style schedule
            whose ``num_stages`` is not ``2 * pp_size``.

    Example::

        >>> stage_ids_this_rank(1, 4, 8, "loop")
        (1, 5)
        >>> stage_ids_this_rank(1, 4, 8, "ScheduleDualPipeV")
        (1, 6)
    """
    for arg, v in (
        ("pp_rank", pp_rank),
        ("pp_size", pp_size),
        ("num_stages", num_stages),
    ):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{arg} must be an int, got {v!r}")
    if pp_size < 1 or num_stages < 1:
        raise ValueError(
            f"pp_size and num_stages must be >= 1, got {pp_size} and {num_stages}"
        )
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} is out of range for pp_size {pp_size}")
    resolved = _style(style)
    if resolved == "v" and num_stages != 2 * pp_size:
        raise ValueError(_v_stage_count_error(style, pp_size, num_stages))
    if num_stages % pp_size != 0:
        raise ValueError(
            f"{num_stages} stages cannot be spread evenly over {pp_size} pipeline "
            f"ranks: every rank runs the same number of stages, so num_stages "
            f"must be a multiple of the pipeline size ({pp_size}, {2 * pp_size}, ...)"
        )
    if resolved == "v":
        return (pp_rank, num_stages - 1 - pp_rank)
    return tuple(range(pp_rank, num_stages, pp_size))


# ---------------------------------------------------------------------------
# Stages for this rank
# ---------------------------------------------------------------------------


def pipeline_group(pp_mesh_or_group: Any) -> tuple[dist.ProcessGroup, int, int]:
    """The pipeline process group, this process's rank in it, and its size.

    Args:
        pp_mesh_or_group: the pipeline dimension as a 1-D ``DeviceMesh``, or a
            ``ProcessGroup``.

    Raises:
        TypeError: neither a ``DeviceMesh`` nor a ``ProcessGroup``.
        ValueError: a mesh of more than one dimension, or a group this
            process is not a member of.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(pp_mesh_or_group, DeviceMesh):
        if pp_mesh_or_group.ndim != 1:
            raise ValueError(
                "pipeline_module_split needs a 1-D pipeline mesh, got a "
                f"{pp_mesh_or_group.ndim}-D mesh; pass "
                'the pipeline dimension, e.g. mesh["pp"]'
            )
        group = pp_mesh_or_group.get_group()
        return group, pp_mesh_or_group.get_local_rank(), pp_mesh_or_group.size()
    if isinstance(pp_mesh_or_group, dist.ProcessGroup):
        rank = dist.get_rank(pp_mesh_or_group)
        if rank < 0:
            raise ValueError(
                "this process is not a member of the given pipeline process group"
            )
        return pp_mesh_or_group, rank, dist.get_world_size(pp_mesh_or_group)
    raise TypeError(
        "pp_mesh_or_group must be a 1-D DeviceMesh or a ProcessGroup, got "
        f"{type(pp_mesh_or_group).__name__}"
    )


def _check_placement(cls: type, module_names_per_stage: Any, pp_size: int) -> int:
    """The number of stages, checked against the schedule class and pipeline size."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    if isinstance(module_names_per_stage, (str, bytes)) or not isinstance(
        module_names_per_stage, Sequence
    ):
        raise TypeError(
            "module_names_per_stage must be a sequence with one sequence of FQNs per "
            f"stage, got {type(module_names_per_stage).__name__}"
        )
    num_stages = len(module_names_per_stage)
    if issubclass(cls, PipelineScheduleSingle) and num_stages != pp_size:
        raise ValueError(
            f"{cls.__name__} runs one stage per rank, but {num_stages} stages were "
            f"given for {pp_size} ranks; use a multi-stage schedule such as "
            "ScheduleInterleaved1F1B"
        )
    return num_stages


def _check_stage_kwargs(
    stage_kwargs: dict[str, Any],
    model: nn.Module,
    num_stages: int,
    device: Any,
    group: Any,
) -> None:
    """``stage_kwargs``: more ``PipelineStage`` arguments, none the split sets."""
    from torch.distributed.pipelining import PipelineStage

    for reserved in ("group", "submodule", "stage_index", "num_stages", "device"):
        if reserved in stage_kwargs:
            raise TypeError(
                f"pipeline_module_split sets {reserved!r} itself; do not pass it in "
                "stage_kwargs"
            )
    try:
        inspect.signature(PipelineStage).bind(
            model, 0, num_stages, device, group=group, **stage_kwargs
        )
    except TypeError as e:
        raise TypeError(f"stage_kwargs do not fit PipelineStage: {e}") from None


def _pipeline_stages(
    parts: Sequence[nn.Module],
    stage_ids: Sequence[int],
    num_stages: int,
    device: torch.device | str | int,
    group: Any,
    stage_kwargs: dict[str, Any],
) -> list[PipelineStage]:
    """A ``PipelineStage`` of each part.  ``device`` is passed as given:
    ``PipelineStage`` annotates it as ``torch.device``, but only hands it on
    to tensor factories and ``.to()``, which take a str or an index too."""
    from torch.distributed.pipelining import PipelineStage

    return [
        PipelineStage(part, stage_id, num_stages, device, group=group, **stage_kwargs)  # type: ignore[arg-type]
        for part, stage_id in zip(parts, stage_ids)
    ]


def pipeline_module_split(
    model: nn.Module,
    pp_mesh_or_group: Any,
    schedule: type | str,
    device: torch.device | str | int,
    module_names_per_stage: Sequence[Sequence[str]],
    *,
    move: bool = False,
    allow_uncovered: bool = False,
    prepare_part: Callable[[nn.Module, int, int], nn.Module] | None = None,
    **stage_kwargs: Any,
) -> tuple[list[PipelineStage], list[nn.Module]]:
    """Build this rank's pipeline stages of ``model``.

    Validates the whole split first (every name exists; no module in two
    stages, except parameter-free ones; no module inside a module of another
    stage; every parameter and persistent buffer in some stage unless
    ``allow_uncovered``; stage count fits the schedule and the group), then
    builds only the stages this rank runs with :func:`build_stage_module` and wraps
    each in a :class:`~torch.distributed.pipelining.PipelineStage`.  Nothing is
    built when a check fails.  Tensors tied across stages are reported with a
    warning naming their FQNs.

    Args:
        model: the whole model (typically on the meta device).
        pp_mesh_or_group: the pipeline dimension as a 1-D ``DeviceMesh``, or a
            ``ProcessGroup``.
        schedule: the schedule class (or name, e.g. ``"Interleaved1F1B"``); it
            decides loop- or V-style placement and, for single-stage schedules,
            requires one stage per rank.
        device: device of the stages (passed to ``PipelineStage``; the stage
            models are not moved).
        module_names_per_stage: one list of FQNs per stage, e.g. from
            :func:`generate_module_names_per_stage`.
        move: move modules out of ``model`` instead of copying them.
        allow_uncovered: allow parameters/buffers that no stage keeps.
        prepare_part: ``prepare_part(part, stage_id, num_stages)`` turns each
            built stage model into the module its ``PipelineStage`` runs
            (e.g. a model family's stage wrapper); the returned parts are
            those modules.
        **stage_kwargs: further ``PipelineStage`` arguments, passed to every
            local stage.

    Returns:
        ``(stages, model_parts)``: this rank's ``PipelineStage`` objects and
        their stage models, in the same order (ascending stage id).
    """
    _check_model(model)
    group, pp_rank, pp_size = pipeline_group(pp_mesh_or_group)
    cls = resolve_schedule_class(schedule)
    num_stages = _check_placement(cls, module_names_per_stage, pp_size)
    _check_stage_kwargs(stage_kwargs, model, num_stages, device, group)
    stage_ids = stage_ids_this_rank(pp_rank, pp_size, num_stages, cls)
    parts = build_stage_modules(
        model,
        module_names_per_stage,
        stage_ids,
        move=move,
        allow_uncovered=allow_uncovered,
    )
    if prepare_part is not None:
        parts = [
            prepare_part(part, stage_id, num_stages)
            for part, stage_id in zip(parts, stage_ids)
        ]
    stages = _pipeline_stages(parts, stage_ids, num_stages, device, group, stage_kwargs)
    logger.info(
        "pipeline rank %d/%d: stages %s of %d (%s placement)",
        pp_rank,
        pp_size,
        list(stage_ids),
        num_stages,
        _style(cls),
    )
    return stages, parts
