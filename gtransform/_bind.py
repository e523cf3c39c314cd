"""Binding a call's arguments: the options of ``graphify``, static arguments, the flat leaves.

The first stage of a call. It takes ``(args, kwargs)`` as the caller passed them and
hands the next stage (``_run``) a :class:`Bound` call: the static arguments apart
(compared by value as part of the signature), the flat leaves of the rest and their
tree structure. It never looks at tensors' values, and never decides whether a
recording matches (that is ``_key``'s).
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ._breaks import ON_BREAK
from ._pool import GraphPool
from ._sizes import check_size_options
from ._tree import flatten_args, holds_tensor, static_leaf_key

__all__ = ["Options", "options", "donation", "Static", "split", "rebuild", "Bound", "bind"]

_fwad = torch.autograd.forward_ad  # its _current_level: -1 unless a dual level is open


class Options(NamedTuple):
    """``graphify``'s options, checked (static argument positions and names mapped onto each other)."""

    static_argnums: Tuple[int, ...]
    static_argnames: Tuple[str, ...]
    pool: Optional[GraphPool]
    maxsize: Optional[int]
    fuse: bool
    on_break: str = "error"
    record_sizes: Any = None  # sizes that vary (see _sizes): None, an int N, or a tuple of sizes
    buckets: Optional[Tuple[int, ...]] = None
    pad: Any = None  # as the caller passed it
    donate_argnums: Tuple[int, ...] = ()  # (checked, mapped onto each other: see donation)
    donate_argnames: Tuple[str, ...] = ()

    def as_kwargs(self) -> Dict[str, Any]:
        """The options as ``graphify`` takes them (copies are made with them)."""
        return self._asdict()


def options(fn: Any, desc: str, static_argnums: Union[int, Sequence[int], None], static_argnames: Union[str, Sequence[str], None],
            pool: Any, maxsize: Any, fuse: Any, on_break: Any = "error", record_sizes: Any = None,
            buckets: Any = None, pad: Any = None, donate: Tuple[Any, Any] = ((), ())) -> Options:
    """Check ``graphify``'s arguments before anything is traced (TypeError / ValueError with the fix).

    The messages name the function (``graphify(step, maxsize=...)``).
    """
    try:
        return _options(fn, desc, static_argnums, static_argnames, pool, maxsize, fuse, on_break, record_sizes,
                        buckets, pad, donate)
    except (TypeError, ValueError) as e:
        msg = str(e)
        if callable(fn) and desc.startswith("graphify(") and msg.startswith("graphify(fn"):
            raise type(e)(desc[:-1] + msg[len("graphify(fn"):]) from None
        raise


def _options(fn: Any, desc: str, static_argnums: Union[int, Sequence[int], None], static_argnames: Union[str, Sequence[str], None],
             pool: Any, maxsize: Any, fuse: Any, on_break: Any, record_sizes: Any, buckets: Any, pad: Any,
             donate: Tuple[Any, Any]) -> Options:
    if not callable(fn):
        hint = (" (a classmethod: put @graphify below @classmethod, on the function itself)"
                if isinstance(fn, classmethod) else "")
        raise TypeError(f"graphify(fn): fn must be callable, got {type(fn).__name__}{hint}")
    target = getattr(fn, "__func__", fn)
    if inspect.isgeneratorfunction(target) or inspect.iscoroutinefunction(target) or inspect.isasyncgenfunction(target):
        kind = ("a generator function" if inspect.isgeneratorfunction(target) else "an async generator function"
                if inspect.isasyncgenfunction(target) else "a coroutine function (async def)")
        raise TypeError(
            f"{desc}: fn is {kind}. Its calls return an object that runs the body later, which a "
            "recording cannot replay (each call would hand back the same, used-up object). Fix: graphify "
            "the tensor work the body does (a plain function it calls), or return a list instead of "
            "yielding.")
    nums = _argnums(static_argnums)
    names = _argnames(static_argnames)
    if maxsize is not None and (not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize < 1):
        raise ValueError(f"graphify(fn, maxsize=...): expected a positive int or None, got {maxsize!r}")
    if not isinstance(fuse, bool):
        raise TypeError(f"graphify(fn, fuse=...): expected a bool, got {fuse!r}")
    if pool is not None and not isinstance(pool, GraphPool):
        raise TypeError(f"graphify(fn, pool=...): expected gt.graph_pool(), got {type(pool).__name__}")
    if not isinstance(on_break, str) or on_break not in ON_BREAK:
        raise ValueError(f"graphify(fn, on_break=...): expected one of {', '.join(map(repr, ON_BREAK))}, got "
                         f"{on_break!r} (what a host read of the call's own data does: raise a GraphifyError, "
                         "record the pieces between reads through TorchDynamo, or run eagerly)")
    nums, names = resolve_static(fn, nums, names, desc)
    record_sizes, buckets, _ = check_size_options(fn, record_sizes, buckets, pad, nums)
    return Options(nums, names, pool, maxsize, fuse, on_break, record_sizes, buckets, pad,
                   *donation(fn, desc, *donate, nums, names))


def donation(fn: Any, desc: str, donate_argnums: Any, donate_argnames: Any, static_nums: Tuple[int, ...],
             static_names: Tuple[str, ...]) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
    """Check ``donate_argnums`` / ``donate_argnames`` (mapped onto each other); a static one is refused."""
    nums, names = resolve_static(fn, _argnums(donate_argnums, "donate_argnums"),
                                 _argnames(donate_argnames, "donate_argnames"), desc, what="donate")
    both = sorted(set(map(str, nums)) & set(map(str, static_nums))) + sorted(set(names) & set(static_names))
    if both:
        raise ValueError(f"{desc}: argument(s) {', '.join(both)} are both static and donated. A static argument "
                         "is a value of the signature, not a tensor whose memory can be given up. Fix: drop it from "
                         "donate_argnums / donate_argnames (or from static_argnums / static_argnames).")
    return nums, names


def _argnums(static_argnums: Any, label: str = "static_argnums") -> Tuple[int, ...]:
    if static_argnums is None:  # as jax.jit
        return ()
    if isinstance(static_argnums, int) and not isinstance(static_argnums, bool):
        return (static_argnums,)
    try:
        if isinstance(static_argnums, (str, bytes, torch.Tensor)):
            raise TypeError
        seq = tuple(static_argnums)
        # operator.index, as jax.jit: "1", 1.7 and True are not argument positions
        if any(isinstance(i, (bool, torch.Tensor)) for i in seq):
            raise TypeError
        return tuple(map(operator.index, seq))
    except (TypeError, ValueError):
        raise TypeError(f"graphify(fn, {label}=...): expected an int or a sequence of ints "
                        f"(argument positions), got {static_argnums!r}") from None


def _argnames(static_argnames: Any, label: str = "static_argnames") -> Tuple[str, ...]:
    if static_argnames is None:
        return ()
    if isinstance(static_argnames, str):
        return (static_argnames,)
    try:
        names = tuple(static_argnames)
    except TypeError:
        names = (None,)  # type: ignore[assignment]
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"graphify(fn, {label}=...): expected a string or strings, got {static_argnames!r}")
    return names


def resolve_static(fn: Callable[..., Any], nums: Tuple[int, ...], names: Tuple[str, ...], desc: str,
                   what: str = "static") -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
    """Map static_argnums and static_argnames (or ``what``'s: donate_) onto each other, like jax.jit."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return nums, names
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind == p.VAR_POSITIONAL for p in params)
    nums_out = set()
    for i in nums:
        j = i + len(positional) if i < 0 else i
        if j < 0 or (j >= len(positional) and not var_pos):
            kw_only = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
            raise ValueError(
                f"{desc}: {what}_argnums={i} is out of range: the function takes {len(positional)} positional "
                f"parameter(s) ({', '.join(p.name for p in positional) or 'none'}). "
                + (f"Fix: name keyword-only parameters with {what}_argnames (e.g. {what}_argnames={kw_only[0]!r})."
                   if kw_only else "Fix: give the position of a positional parameter (0-based, negative from the end).")
            )
        nums_out.add(j)
    names_out = set(names)
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        known = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        unknown = [n for n in names if n not in known]
        if unknown:
            # (jax.jit raises too: a misspelt name would leave the argument traced, silently)
            raise ValueError(
                f"{desc}: {what}_argnames {unknown} name no parameter of the function (its parameters: "
                f"{sorted(known)}). Fix: name a parameter of the function, or give its position with "
                f"{what}_argnums.")
    for j in list(nums_out):
        if j < len(positional) and positional[j].kind == positional[j].POSITIONAL_OR_KEYWORD:
            names_out.add(positional[j].name)
    for n in names:
        for j, p in enumerate(positional):
            if p.name == n and p.kind == p.POSITIONAL_OR_KEYWORD:
                nums_out.add(j)
    return tuple(sorted(nums_out)), tuple(sorted(names_out))


class Static(tuple):
    """``(where, value, key)`` of a static argument, compared by where and key only.

    ``2 == 2.0 == True`` and ``nan != nan`` in Python; the key tells the first apart and
    makes every NaN one signature.
    """

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and self[0] == other[0] and self[2] == other[2]

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash((self[0], self[2]))


def split(desc: str, nums: Any, names: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any], Tuple[Any, ...]]:
    """The call's arguments without its static ones, and those as :class:`Static` values (checked hashable)."""
    statics: List[Tuple[Any, Any]] = []
    dyn = []
    for i, a in enumerate(args):
        if i in nums:
            statics.append((i, a))
        else:
            dyn.append(a)
    if names and kwargs:
        kw = {}
        for k, v in kwargs.items():
            if k in names:
                statics.append((k, v))
            else:
                kw[k] = v
        kwargs = kw
    return tuple(dyn), kwargs, tuple(_keyed(desc, where, v) for where, v in statics)


def _keyed(desc: str, where: Any, v: Any) -> Static:
    try:
        # the value and its key: 2 == 2.0 == True, but they are three signatures
        return Static((where, v, static_leaf_key(v)))
    except TypeError:
        label = f"args[{where}]" if isinstance(where, int) else f"kwargs[{where!r}]"
        if holds_tensor(v):
            raise TypeError(
                f"{desc}: static argument {label} is or holds a tensor. Static arguments are "
                "compared by value as part of the cache key, and a tensor's values are not part of "
                "it. Fix: do not mark it static (tensors are inputs of the recording), or pass a "
                "Python number (t.item() outside the function) if its value should pick the recording."
            ) from None
        raise TypeError(
            f"{desc}: static argument {label} of type {type(v).__name__} is not hashable. "
            "Static arguments are part of the cache key. Fix: pass a hashable value "
            "(e.g. a tuple instead of a list), or do not mark it static."
        ) from None


def rebuild(args: Tuple[Any, ...], statics: Tuple[Any, ...]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The arguments with the static ones put back where they were passed: ``(args, static kwargs)``."""
    pos = [(w, v) for w, v, _k in statics if isinstance(w, int)]
    kw = {w: v for w, v, _k in statics if not isinstance(w, int)}
    if not pos:
        return args, kw
    out = list(args)
    for w, v in sorted(pos):
        out.insert(w, v)
    return tuple(out), kw


class Bound(NamedTuple):
    """A call's arguments bound: as passed, and taken apart for the lookup."""

    args: Tuple[Any, ...]  # as the caller passed them, static ones included (an eager run takes these)
    kwargs: Dict[str, Any]
    leaves: List[Any]  # the flat leaves of the arguments without the static ones
    spec: Any  # their tree structure
    statics: Tuple[Any, ...]  # the static arguments, as Static values
    tree: Tuple[Any, Any]  # (args, kwargs) without the static ones
    dual: bool  # a tensor leaf is a forward-mode dual (a tangent at the open dual level)


def bind(g: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Bound:
    """Bind a call of graphified ``g``: static arguments apart, the others flattened."""
    dyn, kw, statics = args, kwargs, ()
    if g._has_static:
        dyn, kw, statics = split(g._desc, g._static_argnums, g._static_argnames, args, kwargs)
    leaves, spec = flatten_args(dyn, kw, g._desc)
    dual = _fwad._current_level >= 0 and any(
        isinstance(x, torch.Tensor) and _fwad.unpack_dual(x).tangent is not None for x in leaves)
    return Bound(args, kwargs, leaves, spec, statics, (dyn, kw), dual)
