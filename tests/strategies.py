"""Hypothesis strategies for pytrees of tensors (one module, like attrs' tests).

A generated tree holds :class:`TensorSpec` placeholders where tensors go, plus
static Python leaves (ints, floats, strings) and ``None`` (an empty subtree
under gtransform's policy). ``build(tree, device)`` turns the placeholders into
tensors on a device, so one drawn tree serves every device and can be rebuilt
with fresh values (``build(tree, device, salt=k)``) or as independent copies.

Containers: dicts (string keys), lists, tuples and a namedtuple, nested.
Tensor leaves: mostly real shapes (1-d to 4-d, sides 2 to 5, so several
elements), sometimes 0-d, size-1 or empty ones (a 0 in the shape); dtypes
float32, float64, bfloat16, int64 and bool; and memory layouts other than
contiguous: transposed/permuted, sliced with a step, offset into a bigger
base, and expanded (stride 0) views, as callers really pass them.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, List, Optional, Sequence, Tuple

import optree
import torch
from hypothesis import strategies as st

__all__ = [
    "DTYPES",
    "FLOAT_DTYPES",
    "LAYOUTS",
    "Pair",
    "TensorSpec",
    "build",
    "clone_tree",
    "dtypes",
    "layouts",
    "map_specs",
    "pytrees",
    "shapes",
    "static_leaves",
    "tensor_leaves",
    "tensor_specs",
    "tree_and_builder",
]

NAMESPACE = "gtransform"

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
DTYPES = FLOAT_DTYPES + (torch.int64, torch.bool)

Pair = collections.namedtuple("Pair", ["first", "second"])

# How a tensor leaf sits in memory (see TensorSpec.make). Layouts that do not
# apply to a shape (transposing a 1-d tensor, say) fall back to "contiguous".
LAYOUTS = ("contiguous", "transposed", "sliced", "offset", "expanded")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Where a tensor goes in a generated tree: its shape, dtype, values seed and layout.

    A frozen dataclass is a leaf for optree (it is not a registered node).
    ``special`` adds NaN/inf/-inf values to float tensors. ``layout`` is one
    of :data:`LAYOUTS`: the tensor is then a view of a bigger or permuted base.
    """

    shape: Tuple[int, ...]
    dtype: torch.dtype
    seed: int
    special: bool = False
    layout: str = "contiguous"

    def effective_layout(self) -> str:
        """The layout ``make`` gives this shape (some layouts need dimensions)."""
        nd = len(self.shape)
        if self.layout == "transposed" and nd < 2:
            return "contiguous"
        if self.layout in ("sliced", "offset", "expanded") and nd < 1:
            return "contiguous"
        return self.layout

    def make(self, device: Any, salt: int = 0) -> torch.Tensor:
        """The tensor of this spec on ``device``; ``salt`` gives other values."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + salt * 7919) % (2**63))
        shape = tuple(self.shape)
        layout = self.effective_layout()
        if layout == "transposed":  # a permutation of a contiguous base: reversed strides
            base_shape = shape[::-1]
        elif layout == "sliced":  # every other element of the last dimension
            base_shape = shape[:-1] + (2 * shape[-1] + 1,)
        elif layout == "offset":  # rows 1.. of a base with one more row: a storage offset
            base_shape = (shape[0] + 1,) + shape[1:]
        elif layout == "expanded":  # the first dimension broadcast: stride 0
            base_shape = (1,) + shape[1:]
        else:
            base_shape = shape
        base = self._values(base_shape, gen).to(device)
        if layout == "transposed":
            return base.permute(*reversed(range(len(shape))))
        if layout == "sliced":
            return base[..., 1::2]
        if layout == "offset":
            return base[1:]
        if layout == "expanded":
            return base.expand(shape)
        return base

    def _values(self, shape: Tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        if self.dtype.is_floating_point:
            t = torch.randn(shape, generator=gen, dtype=torch.float64) * 3
            if self.special and t.numel():
                flat = t.view(-1)
                specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0], dtype=torch.float64)
                idx = torch.randint(0, flat.numel(), (min(3, flat.numel()),), generator=gen)
                flat[idx] = specials[torch.randint(0, len(specials), (len(idx),), generator=gen)]
            return t.to(self.dtype)
        if self.dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=gen).bool()
        return torch.randint(-9, 10, shape, generator=gen, dtype=self.dtype)


def dtypes(choices: Sequence[torch.dtype] = DTYPES) -> st.SearchStrategy[torch.dtype]:
    return st.sampled_from(list(choices))


def shapes(max_dims: int = 4, max_side: int = 5) -> st.SearchStrategy[Tuple[int, ...]]:
    """Shapes of up to ``max_dims`` dimensions.

    Mostly real ones (1 to ``max_dims`` dimensions of sides 2 to ``max_side``, 2-d of side 3 first:
    several elements, so a wrong stride or a swapped element shows); one in
    five is a corner case: 0-d, sides of 1, or empty (a side of 0).
    """
    if max_dims == 0:
        return st.just(())
    # sampled_from favours (and shrinks to) its first element: 2-d of side 3
    dims = st.sampled_from([d for d in (2, 3, 1, 4, 2, 3) if d <= max_dims] or [1])
    sides = st.sampled_from([n for n in (3, 4, 2, 5) if n <= max_side] or [max_side])
    real = dims.flatmap(lambda n: st.tuples(*[sides] * n))
    corner = st.sampled_from(["0d", "ones", "empty"]).flatmap(
        lambda kind: (
            st.just(())
            if kind == "0d"
            else dims.flatmap(
                lambda n: st.tuples(*[st.integers(1, max_side) if kind == "ones" else st.integers(0, 3)] * n).map(
                    lambda s: s if kind == "ones" else (0,) + s[1:]
                )
            )
        )
    )
    return st.sampled_from(["real", "real", "real", "real", "corner"]).flatmap(lambda k: real if k == "real" else corner)


def layouts() -> st.SearchStrategy[str]:
    """Memory layouts (the engine favours the first, contiguous, itself)."""
    return st.sampled_from(LAYOUTS)


def tensor_specs(
    dtype_choices: Sequence[torch.dtype] = DTYPES,
    max_dims: int = 4,
    special: bool = False,
    layout_choices: Optional[Sequence[str]] = None,
) -> st.SearchStrategy[TensorSpec]:
    """Tensor leaves; ``layout_choices`` restricts the layouts (default: all of :data:`LAYOUTS`)."""
    return st.builds(
        TensorSpec,
        shape=shapes(max_dims),
        dtype=dtypes(dtype_choices),
        seed=st.integers(0, 2**31 - 1),
        special=st.booleans() if special else st.just(False),
        layout=layouts() if layout_choices is None else st.sampled_from(list(layout_choices)),
    )


def static_leaves() -> st.SearchStrategy[Any]:
    """Static Python leaves: ints, finite floats, short strings (and None, an empty subtree)."""
    return st.one_of(
        st.integers(-5, 5),
        st.floats(-4, 4, allow_nan=False, allow_infinity=False, width=32),
        st.text(alphabet="abcxyz", max_size=3),
        st.none(),
    )


_KEYS = st.sampled_from(["a", "b", "c", "w", "x", "y", "long_key"])


def pytrees(
    leaves: Optional[st.SearchStrategy[Any]] = None,
    *,
    dtype_choices: Sequence[torch.dtype] = DTYPES,
    statics: bool = True,
    special: bool = False,
    max_leaves: int = 8,
    min_tensors: int = 1,
    layout_choices: Optional[Sequence[str]] = None,
) -> st.SearchStrategy[Any]:
    """Nested dicts/lists/tuples/namedtuples of TensorSpec and static leaves.

    About three trees in four hold at least ``min_tensors`` tensors; the rest
    may hold none (empty containers, statics only). ``min_tensors=0``: no bias.
    """
    if leaves is None:
        tl = tensor_specs(dtype_choices, special=special, layout_choices=layout_choices)
        leaves = st.one_of(tl, static_leaves()) if statics else tl

    def extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(_KEYS, children, max_size=3),
            st.builds(Pair, children, children),
        )

    trees = st.recursive(leaves, extend, max_leaves=max_leaves)
    if not min_tensors:
        return trees

    def enough(tree: Any) -> bool:
        n = sum(isinstance(x, TensorSpec) for x in optree.tree_leaves(tree, none_is_leaf=False, namespace=NAMESPACE))
        return n >= min_tensors

    # mostly trees with tensors, sometimes anything (empty containers, statics only)
    with_tensors = trees.filter(enough)
    return st.one_of(with_tensors, with_tensors, with_tensors, trees)


def map_specs(fn: Callable[[TensorSpec], Any], tree: Any) -> Any:
    """Apply ``fn`` to every TensorSpec of ``tree`` (other leaves kept)."""
    return optree.tree_map(
        lambda x: fn(x) if isinstance(x, TensorSpec) else x, tree, none_is_leaf=False, namespace=NAMESPACE
    )


def build(tree: Any, device: Any, salt: int = 0) -> Any:
    """The tree with tensors on ``device`` in place of its TensorSpecs."""
    return map_specs(lambda s: s.make(device, salt), tree)


def clone_tree(tree: Any) -> Any:
    """A copy of a tree of tensors (clones; statics shared)."""
    return optree.tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree, none_is_leaf=False, namespace=NAMESPACE
    )


def tensor_leaves(tree: Any) -> List[torch.Tensor]:
    leaves = optree.tree_leaves(tree, none_is_leaf=False, namespace=NAMESPACE)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def tree_and_builder(**kw: Any) -> st.SearchStrategy[Tuple[Any, Callable[..., Any]]]:
    """``(spec_tree, builder)`` where ``builder(device, salt=0)`` makes the tensor tree."""
    return pytrees(**kw).map(lambda t: (t, lambda device, salt=0: build(t, device, salt)))
