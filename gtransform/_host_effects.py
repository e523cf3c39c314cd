"""Host-side effects a replay cannot repeat, found around a trace.

Eager runs the function's Python on every call; a replay runs none of it. What the
Python does besides tensor work is watched here: the caller's ``torch.Generator``
objects seeded or drawn from inside, host random number generators (Python's
``random``, NumPy's), optimizers stepped that the roots do not hold
(:class:`UnseenOptimizers`), Python numbers bound in globals, closure cells or class
attributes (counters), iterators advanced (``next(it)``), and ``functools`` caches
grown while tracing (cleared after the trace: they would hold its placeholders).
"""

from __future__ import annotations

import functools
import operator
import random
import sys
import threading
import types
from typing import Any, List, Sequence, Set, Tuple

import torch

from ._errors import GraphifyError
from ._roots import Root, _candidates, _Module, _Optimizer, _plain_object

__all__ = ["GeneratorGuard", "UnseenOptimizers", "number_bindings", "iterators", "iterator_position", "function_caches",
           "global_settings", "settings_left_changed"]


class GeneratorGuard:
    """The caller's own ``torch.Generator`` objects the function reaches, checked around a trace.

    A ``g.manual_seed(...)`` or ``g.set_state(...)`` inside the function happens once,
    while tracing; eager does it on every call (the same numbers every call), a replay
    never (new numbers). Such a change is undone and refused. (The default generators
    are watched by ``_watch._no_seeding``.)
    """

    def __init__(self, fn: Any, extra: Sequence[Tuple[str, Any]], roots: Sequence[Root]):
        found: List[Tuple[str, torch.Generator]] = []
        cands: List[Tuple[str, Any]] = []
        _candidates(fn, 0, cands, set())
        cands += list(extra)
        for r in roots:
            obj = r.obj
            items = (obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list)
                     else vars(obj).items() if hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor) else ())
            cands += [(f"{r.name}.{k}" if hasattr(obj, "__dict__") else f"{r.name}[{k!r}]", v) for k, v in items]
        self.defaults = [torch.default_generator]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.defaults += list(torch.cuda.default_generators)
        seen: Set[int] = set()
        for name, v in cands:
            _generators_in(name, v, 0, seen, found)
        # host generators the function reaches (random.Random, numpy's Generator and RandomState):
        # their numbers would be constants of the recording (see _trace._host_rng_state)
        self.host: List[Tuple[str, Any]] = [(name, g) for name, g in found if _is_host_rng(g)]
        found = [(name, g) for name, g in found if isinstance(g, torch.Generator) and all(g is not d for d in self.defaults)]
        self.saved = [(name, g, g.initial_seed(), g.get_state()) for name, g in found]

    def refuse_unknown(self, desc: str, used: Sequence[Tuple[torch.Generator, str]]) -> None:
        """Refuse a generator the random ops drew from that is none of the caller's (made inside the function).

        ``used``: each generator the trace's random ops took, with the line of its first draw.
        (The ops see a new Python object for the caller's own generator: it is matched by a
        probe of the seed, set back at once.)
        """
        known = self.defaults + [g for _, g, _, _ in self.saved]
        for gen, line in used:
            if not any(_same_generator(gen, k) for k in known):
                raise GraphifyError(
                    f"{desc}: a random op draws from a torch.Generator that the function makes "
                    f"(torch.Generator().manual_seed(...) inside it), or reaches where graphify does not look.\n"
                    f"  at {line}\n"
                    "Why: the function runs once, while tracing; eager makes a new generator on every "
                    "call (the same numbers every call), a recording would go on drawing from the one "
                    "made while tracing (new numbers every call).\n"
                    "Fix: make the generator outside the function and pass it as an argument, seeding it "
                    "before each call where the same numbers are wanted (g.manual_seed(0); f(x, g)); or "
                    "draw the numbers outside and pass them in."
                )

    def check(self, desc: str, raise_: bool) -> None:
        """Undo a seed or state the trace set on a generator; refuse it where ``raise_``."""
        changed = []
        for name, g, seed, state in self.saved:
            if g.initial_seed() != seed or not torch.equal(g.get_state(), state):
                g.set_state(state)
                changed.append(name)
        if changed and raise_:
            raise GraphifyError(
                f"{desc}: the function seeds or sets the state of the torch.Generator {changed[0]} "
                "(g.manual_seed(...), g.set_state(...)) inside it.\n"
                "Why: a recording draws fresh numbers from the generator's current state on every "
                "replay; a seed set inside the function happens once, while tracing, so eager would "
                "draw the same numbers on every call and the recording different ones.\n"
                f"Fix: seed {changed[0]} outside the function, before each call where the same numbers "
                "are wanted (g.manual_seed(5); f(x)), or draw them outside and pass them in."
            )


def _is_host_rng(v: Any) -> bool:
    """A Python or numpy random generator object (not a module's global one)."""
    if isinstance(v, random.Random):
        return True
    np = sys.modules.get("numpy")
    return np is not None and isinstance(v, (np.random.Generator, np.random.RandomState))


def _generators_in(name: str, v: Any, depth: int, seen: Set[int], out: List[Tuple[str, Any]]) -> None:
    """The generators in ``v`` (torch's, Python's, numpy's): itself, or in its containers, attributes and submodules (3 levels)."""
    if id(v) in seen or depth > 3:
        return
    seen.add(id(v))
    if isinstance(v, torch.Generator) or _is_host_rng(v):
        out.append((name, v))
        return
    if isinstance(v, _Module):
        for sub_name, sub in v.named_modules():
            for k, x in vars(sub).items():
                if isinstance(x, torch.Generator) or _is_host_rng(x) or (
                        k[:1] != "_" and (_plain_object(x) or type(x) in (list, tuple, dict))):
                    _generators_in(f"{name}.{sub_name}.{k}" if sub_name else f"{name}.{k}", x, depth + 1, seen, out)
        return
    if type(v) in (list, tuple):
        items: Any = enumerate(v)
    elif type(v) is dict:
        items = v.items()
    elif _plain_object(v):
        items = vars(v).items()
    else:
        return
    for k, x in list(items):
        _generators_in(f"{name}[{k!r}]" if type(v) in (list, tuple, dict) else f"{name}.{k}", x, depth + 1, seen, out)


def _same_generator(a: torch.Generator, b: torch.Generator) -> bool:
    """Whether ``a`` and ``b`` are one generator (two Python objects of one: a probe of ``b``'s seed)."""
    if a is b:
        return True
    if a.device != b.device:
        return False
    state = b.get_state()
    probe = (b.initial_seed() ^ 0x5DEECE66D) & 0x7FFFFFFFFFFFFFFF or 1
    b.manual_seed(probe)
    try:
        return a.initial_seed() == probe
    finally:
        b.set_state(state)


class UnseenOptimizers:
    """While a trace runs: an optimizer the function steps that is none of the roots is refused before it steps.

    Its lazily made state (momentum, Adam's moments) would be made while tracing, left in
    ``opt.state`` as placeholders that no snapshot puts back (the optimizer broken for eager
    use too). A global step pre-hook (torch's public one) that acts in the tracing thread only.
    """

    def __init__(self, roots: Sequence[Root], desc: str):
        self.known = {id(r.obj) for r in roots if isinstance(r.obj, _Optimizer)}
        self.desc = desc
        self.handle: Any = None

    def __enter__(self) -> UnseenOptimizers:
        self.thread = threading.get_ident()
        try:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self.handle = register_optimizer_step_pre_hook(self._check)
        except ImportError:  # pragma: no cover - an older torch: not watched
            self.handle = None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.handle is not None:
            self.handle.remove()

    def _check(self, opt: Any, args: Any, kwargs: Any) -> None:
        if threading.get_ident() != self.thread or id(opt) in self.known:
            return
        raise GraphifyError(
            f"{self.desc}: the function steps a {type(opt).__name__} optimizer that gtransform does not find "
            "among the objects it reaches.\n"
            "Why: the state an optimizer makes on its first step (momentum, Adam's moments) would be made "
            "while tracing, out of gtransform's sight, and a replay would not update it.\n"
            "Fix: let the function reach it through a closure, a global name, an argument (a module or "
            "object holding it), or an attribute of a module or object it reaches, at most 4 levels deep "
            "(not through a weakref or a cached factory function); or keep opt.step() outside."
        )


def number_bindings(named: Sequence[Tuple[str, Any, str, Any]]) -> List[Tuple[str, Any, str]]:
    """Names bound to Python numbers among ``named`` (:func:`named_values` of the function): ``(path, where, key)``.

    A trace that changes one (a counter: the trace's increment happens once, a replay's never)
    is seen as any other Python change the trace makes (see Snapshot.scan).
    """
    return [(path, where, key) for path, where, key, v in named if type(v) in _COUNTS]


def iterators(named: Sequence[Tuple[str, Any, str, Any]]) -> List[Tuple[str, Any]]:
    """The iterators among ``named`` (``it = iter(loader)``, a generator): ``(path, iterator)``."""
    out: List[Tuple[str, Any]] = []
    for path, _where, _key, v in named:
        if hasattr(type(v), "__next__") and not isinstance(v, torch.Tensor) and all(v is not o for _p, o in out):
            out.append((path, v))
    return out


def iterator_position(it: Any) -> Any:
    """How far ``it`` has gone, in a form that changes when an item is taken (None: cannot say)."""
    if isinstance(it, types.GeneratorType):
        frame = it.gi_frame
        return None if frame is None else ("gen", frame.f_lasti, tuple(map(id, frame.f_locals.values())))
    n = getattr(it, "_num_yielded", None)  # (a DataLoader's iterator)
    if isinstance(n, int):
        return ("loader", n)
    try:
        # (a list's, tuple's or range's iterator: its index; itertools.count's next value,
        # cycle's saved items: what pickling it would keep)
        return ("reduce", _position_key(it.__reduce__(), 0))
    except Exception:
        pass
    try:
        return ("hint", operator.length_hint(it, -1))
    except Exception:  # pragma: no cover
        return None


def _position_key(v: Any, depth: int) -> Any:
    """``v`` (an iterator's ``__reduce__()``) as a comparable key.

    Numbers and strings by value, containers item by item, other objects (the iterated
    sequence, tensors) by identity.
    """
    if isinstance(v, (int, float, str, bytes, bool, type(None))):
        return v
    if isinstance(v, (tuple, list)) and depth < 4:
        return (type(v).__name__, len(v)) + tuple(_position_key(x, depth + 1) for x in v[:64])
    return ("id", id(v))


def function_caches(named: Sequence[Tuple[str, Any, str, Any]]) -> List[Any]:
    """The ``functools.lru_cache`` / ``functools.cache`` functions among ``named`` (a causal mask, a RoPE table).

    A call while tracing stores a placeholder there, which the next eager call would get back:
    a cache that grew while tracing is emptied after it (see Snapshot.restore).
    """
    out: List[Any] = []
    for _path, _where, _key, v in named:
        if callable(getattr(v, "cache_clear", None)) and callable(getattr(v, "cache_info", None)) and \
                all(v is not o for o in out):
            out.append(v)
    return out


_COUNTS = (int, float, bool)


# -- torch's global settings -----------------------------------------------------------------------

def _deterministic() -> Any:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _set_deterministic(v: Any) -> None:
    torch.use_deterministic_algorithms(v[0], warn_only=v[1])


def _autocast(d: str) -> Any:
    return torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)


def _set_autocast(d: str, v: Any) -> None:
    torch.set_autocast_enabled(d, v[0])
    torch.set_autocast_dtype(d, v[1])


# (what the message calls it, read it, put it back, how its value reads)
_SETTINGS: List[Tuple[str, Any, Any, str]] = [
    ("torch.set_default_dtype", torch.get_default_dtype, torch.set_default_dtype, "{}"),
    ("torch.set_grad_enabled", torch.is_grad_enabled, torch.set_grad_enabled, "{}"),
    ("torch.use_deterministic_algorithms", _deterministic, _set_deterministic, "{0[0]}, warn_only={0[1]}"),
] + [
    (f"torch.set_autocast_enabled({d!r}, ...) / set_autocast_dtype", functools.partial(_autocast, d),
     functools.partial(_set_autocast, d), "enabled={0[0]}, dtype={0[1]}")
    for d in ("cpu", "cuda")
]


def global_settings() -> List[Any]:
    """The global settings of torch a function could change and leave changed (read before it runs)."""
    return [get() for _, get, _, _ in _SETTINGS]


def settings_left_changed(desc: str, before: Sequence[Any], site: str = "") -> None:
    """Refuse a function that leaves one of torch's global settings changed; put them back first.

    Eager changes the setting on every call (and the code after the call runs under it);
    a replay runs none of the function's Python, so the setting would change only on the
    traced call.
    """
    changed = []
    for (name, get, put, fmt), old in zip(_SETTINGS, before):
        new = get()
        if new != old:
            put(old)
            changed.append(f"{name}({fmt.format(new)}) (it was {fmt.format(old)})")
    if changed:
        raise GraphifyError(
            f"{desc}: the function leaves {'; '.join(changed)} in effect when it returns.\n"
            "Why: eager sets it on every call; a replay runs none of the function's Python, so it would "
            "be set on the traced call only.\n"
            "Fix: set it outside the graphified function, before calling it, or put it back before "
            "returning (a with-block such as torch.no_grad(), or try/finally)."
            + (f"\n  at {site}" if site else "")
        )
