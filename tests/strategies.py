"""Hypothesis strategies for pytrees of tensors (one module, like attrs' tests).

A generated tree holds :class:`TensorSpec` placeholders where tensors go, plus
static Python leaves (ints, floats, strings) and ``None`` (an empty subtree
under gtransform's policy). ``build(tree, device)`` turns the placeholders into
tensors on a device, so one drawn tree serves every device and can be rebuilt
with fresh values (``build(tree, device, salt=k)``) or as independent copies.

Containers: dicts (string keys), lists, tuples and a namedtuple, nested.
Tensor leaves: shapes from 0-d to 3-d, including empty ones (a 0 in the
shape); dtypes float32, float64, bfloat16, int64 and bool.
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
    "Pair",
    "TensorSpec",
    "build",
    "clone_tree",
    "dtypes",
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


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Where a tensor goes in a generated tree: its shape, dtype and values seed.

    A frozen dataclass is a leaf for optree (it is not a registered node).
    ``special`` adds NaN/inf/-inf values to float tensors.
    """

    shape: Tuple[int, ...]
    dtype: torch.dtype
    seed: int
    special: bool = False

    def make(self, device: Any, salt: int = 0) -> torch.Tensor:
        """The tensor of this spec on ``device``; ``salt`` gives other values."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + salt * 7919) % (2**63))
        if self.dtype.is_floating_point:
            t = torch.randn(self.shape, generator=gen, dtype=torch.float64) * 3
            if self.special and t.numel():
                flat = t.view(-1)
                specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0], dtype=torch.float64)
                idx = torch.randint(0, flat.numel(), (min(3, flat.numel()),), generator=gen)
                flat[idx] = specials[torch.randint(0, len(specials), (len(idx),), generator=gen)]
            t = t.to(self.dtype)
        elif self.dtype == torch.bool:
            t = torch.randint(0, 2, self.shape, generator=gen).bool()
        else:
            t = torch.randint(-9, 10, self.shape, generator=gen, dtype=self.dtype)
        return t.to(device)


def dtypes(choices: Sequence[torch.dtype] = DTYPES) -> st.SearchStrategy[torch.dtype]:
    return st.sampled_from(list(choices))


def shapes(max_dims: int = 3, max_side: int = 4) -> st.SearchStrategy[Tuple[int, ...]]:
    """Shapes from 0-d to ``max_dims``-d; sides may be 0 (empty tensors)."""
    return st.lists(st.integers(0, max_side), min_size=0, max_size=max_dims).map(tuple)


def tensor_specs(
    dtype_choices: Sequence[torch.dtype] = DTYPES, max_dims: int = 3, special: bool = False
) -> st.SearchStrategy[TensorSpec]:
    return st.builds(
        TensorSpec,
        shape=shapes(max_dims),
        dtype=dtypes(dtype_choices),
        seed=st.integers(0, 2**31 - 1),
        special=st.booleans() if special else st.just(False),
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
) -> st.SearchStrategy[Any]:
    """Nested dicts/lists/tuples/namedtuples of TensorSpec and static leaves.

    About three trees in four hold at least ``min_tensors`` tensors; the rest
    may hold none (empty containers, statics only). ``min_tensors=0``: no bias.
    """
    if leaves is None:
        tl = tensor_specs(dtype_choices, special=special)
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
