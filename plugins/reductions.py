"""The step's global scalars: several sums over lists of tensors, fused into one vector.

A sharpness-aware step is pointwise except for a few scalars (``||g_t||``, ``||d_t||``,
``<g_t, v_{t-1}>``, ``||T v_t||``, GSAM's ``<g_t, h_t>``, the diagnostics' sums).  They are
asked for by name in a :class:`Sums` and computed together: one float64 vector on the
tensors' device, one ``all_reduce`` where the sums cross ranks, one host read
(:meth:`Sums.read`) for all of them.  No formula of the algorithm lives here: a norm of
something derived from the lists (VASSO's next ``d_t``, before it is written) takes the
derivation as a function (:meth:`Sums.norm_of`), from :mod:`plugins.perturbation`.  Torch only.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

Tensors = Sequence[torch.Tensor]

__all__ = ["FLAT_BELOW", "FLAT_CHUNK", "LONG_CHUNK", "WIDE_CHUNK", "LOW_PRECISION", "chunk_plan", "Sums", "global_norm", "dot", "long_dot",
           "long_norm"]

#: Tensors smaller than this many elements are flattened together (one ``torch.cat``
#: per chunk), so that a model of many small tensors costs a few kernels instead of
#: one per tensor; larger tensors are reduced where they are, without a copy.
FLAT_BELOW = 1 << 15
#: A chunk of flattened tensors holds at most this many elements (the transient copy).
FLAT_CHUNK = 1 << 20

#: A norm or inner product over one tensor longer than this many elements is taken in
#: pieces of this length: cuBLAS's dot takes a 32-bit length (it raises from 2^31 elements,
#: a 2.15-billion-parameter flat buffer), and one piece keeps every shorter tensor's rounding.
LONG_CHUNK = 1 << 30
#: fp16/bf16 are reduced in float32; an inner product of theirs widens this many elements
#: of each at a time (the transient copies: 64 MiB each).
WIDE_CHUNK = 1 << 24
LOW_PRECISION = (torch.float16, torch.bfloat16)

_NORM, _INNER, _NORM_OF = "norm", "inner", "norm_of"


def long_dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``<x, y>`` of two 1-D tensors of any length (0-dim): in their dtype, one ``torch.dot`` up
    to :data:`LONG_CHUNK` elements, else the sum of the pieces' dots; fp16/bf16 in float32,
    widened :data:`WIDE_CHUNK` elements at a time (their own dot rounds the sum to 8 or 11 bits)."""
    if x.dtype in LOW_PRECISION:
        if x.numel() <= WIDE_CHUNK:
            return torch.dot(x.float(), y.float())
        return torch.stack([torch.dot(a.float(), b.float()) for a, b in zip(x.split(WIDE_CHUNK), y.split(WIDE_CHUNK))]).sum()
    if x.numel() <= LONG_CHUNK:
        return torch.dot(x, y)
    return torch.stack([torch.dot(a, b) for a, b in zip(x.split(LONG_CHUNK), y.split(LONG_CHUNK))]).sum()


def long_norm(x: torch.Tensor) -> torch.Tensor:
    """``||x||`` of a tensor of any length (0-dim), in pieces as :func:`long_dot`: in its dtype,
    fp16/bf16 in float32 (fp16's own norm overflows at 65504)."""
    wide = torch.float32 if x.dtype in LOW_PRECISION else None
    if x.numel() <= LONG_CHUNK:
        return torch.linalg.vector_norm(x, dtype=wide)
    flat = x.reshape(-1)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(c, dtype=wide)
                                                 for c in flat.split(LONG_CHUNK)]))


def chunk_plan(tensors: Tensors) -> List[List[int]]:
    """Index groups of ``tensors`` that a reduction flattens together: same device and
    dtype, each under :data:`FLAT_BELOW` elements, at most :data:`FLAT_CHUNK` in all (a
    larger tensor forms a group alone).  Depends only on the tensors' sizes, devices and
    dtypes, so callers cache it."""
    plan: List[List[int]] = []
    open_chunks: dict = {}
    for i, t in enumerate(tensors):
        n = t.numel()
        if n >= FLAT_BELOW:
            plan.append([i])
            continue
        key = (t.device, t.dtype)
        chunk = open_chunks.get(key)
        if chunk is None or chunk[1] + n > FLAT_CHUNK:
            chunk = open_chunks[key] = [[], 0]
            plan.append(chunk[0])
        chunk[0].append(i)
        chunk[1] += n
    return plan


class Sums:
    """Named sums over lists of tensors of the same shapes, reduced together.

    * :meth:`norm`: ``||xs||``, one global L2 norm;
    * :meth:`inner`: ``<xs, ys>``;
    * :meth:`norm_of`: ``||f(*lists)||`` for a pointwise ``f`` over lists of tensors,
      computed on the fly (and not kept): VASSO's ``||d_t||`` before ``d_t`` is written;

    and, after them, ``extra`` tensors of :meth:`reduce` (named too), summed like the rest.

    The small tensors of each chunk of :func:`chunk_plan` are flattened once per list
    (one ``torch.cat``) and reduced with one kernel per term; large tensors are reduced
    where they are (norms with one ``torch._foreach_norm``).  fp16/bf16 are reduced in
    float32 (no overflow of the sum of squares); the partial sums add up in float64.

    ``layout`` (:class:`plugins.distributed.Layout`): the tensors are this rank's local
    parts (DTensor shards, or a partition of the parameters); only the ones it
    ``counted`` enter, and the partial sums (squares and inner products, not norms) are
    summed over its groups with one ``all_reduce`` before the square roots are taken.
    Every rank must then reduce alike, whatever it holds (an empty shard included)."""

    __slots__ = ("names", "terms", "extra_names", "extra_sizes")

    def __init__(self):
        self.names: List[str] = []
        self.terms: List[tuple] = []
        self.extra_names: List[str] = []
        self.extra_sizes: List[int] = []

    def _add(self, name: str, term: tuple) -> "Sums":
        if name in self.names:
            raise ValueError(f"the sum {name!r} is asked for twice")
        self.names.append(name)
        self.terms.append(term)
        return self

    def norm(self, name: str, xs: Tensors) -> "Sums":
        return self._add(name, (_NORM, xs))

    def inner(self, name: str, xs: Tensors, ys: Tensors) -> "Sums":
        return self._add(name, (_INNER, xs, ys))

    def norm_of(self, name: str, pointwise: Callable[..., List[torch.Tensor]], *lists: Tensors) -> "Sums":
        return self._add(name, (_NORM_OF, pointwise) + lists)

    def __contains__(self, name: str) -> bool:
        return name in self.names

    # -------------------------------------------------------------- computing them

    def local(self, plan: Optional[List[List[int]]] = None, layout=None) -> torch.Tensor:
        """This rank's partial sums (squares for the norms, no square root) over the
        tensors ``layout`` counts, with no collective: to be reduced later (another
        reduction's ``extra``, or :class:`plugins.distributed.AscentExchange`'s gather)."""
        terms = self.terms
        if layout is not None and layout.counted is not None:
            keep = layout.counted
            terms = [tuple([xs[i] for i in keep] if isinstance(xs, (list, tuple)) else xs for xs in term)
                     for term in terms]
        return _partial_sums(terms, plan, layout)

    def finish(self, sums: torch.Tensor) -> torch.Tensor:
        """The values from their global sums (the partial sums summed over the ranks,
        however): the square roots of the norms; entries past the terms as they are."""
        is_norm = [t[0] != _INNER for t in self.terms] + [False] * (sums.numel() - len(self.terms))
        if not any(is_norm):
            return sums
        # the roots entry by entry: a mask tensor would be a host-to-device copy per call
        return torch.stack([v.clamp(min=0.0).sqrt() if n else v for v, n in zip(sums.unbind(0), is_norm)])

    def reduce(self, plan: Optional[List[List[int]]] = None, *, layout=None,
               extra: Optional[Dict[str, torch.Tensor]] = None) -> torch.Tensor:
        """Every value as one float64 vector on the tensors' device (no host sync):
        the terms, then the values of the ``extra`` tensors, flattened, in their order."""
        partial = self.local(plan, layout)
        self.extra_names, self.extra_sizes = [], []
        if extra:
            parts = [partial]
            for name, e in extra.items():
                e = e.detach().reshape(-1).to(partial.device, torch.float64)
                self.extra_names.append(name)
                self.extra_sizes.append(e.numel())
                parts.append(e)
            partial = torch.cat(parts)
        if layout is not None and layout.collective:
            layout.all_reduce(partial)
        return self.finish(partial)

    def read(self, values: torch.Tensor) -> Dict[str, Any]:
        """The values by name as floats: the one host synchronization for all of them.
        An ``extra`` entry of one element reads as a float, a longer one as a list."""
        floats = values.tolist()
        out: Dict[str, Any] = dict(zip(self.names, floats))
        at = len(self.names)
        for name, size in zip(self.extra_names, self.extra_sizes):
            out[name] = floats[at] if size == 1 else floats[at:at + size]
            at += size
        return out


def _flat(tensors: Tensors, chunk: List[int]) -> torch.Tensor:
    t = torch.cat([tensors[i].reshape(-1) for i in chunk])
    return t.float() if t.dtype in LOW_PRECISION else t


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened, in float32 if it is fp16/bf16."""
    t = t.reshape(-1)
    return t.float() if t.dtype in LOW_PRECISION else t


def _partial_sums(terms: Sequence[tuple], plan: Optional[List[List[int]]], layout) -> torch.Tensor:
    """The local sums of squares (norm terms) and inner products, float64."""
    first = terms[0][1] if terms[0][0] != _NORM_OF else terms[0][2]
    if len(first) == 0:
        device = layout.device if layout is not None else torch.device("cpu")
        return torch.zeros(len(terms), dtype=torch.float64, device=device)
    plan = chunk_plan(first) if plan is None else plan
    alone = [c[0] for c in plan if len(c) == 1]
    chunks = [c for c in plan if len(c) > 1]
    flats: dict = {}

    def flat(xs, k):
        key = (id(xs), k)
        f = flats.get(key)
        if f is None:
            f = flats[key] = _flat(xs, chunks[k])
        return f

    def pieces(xs):  # the large tensors, then the flat chunks
        return [_wide(xs[i]) for i in alone] + [flat(xs, k) for k in range(len(chunks))]

    device = first[0].device  # a model split over devices: its partial sums meet on the first one

    def total(parts):
        return torch.stack([q.double().to(device) for q in parts])

    results = []
    for kind, *args in terms:
        if kind == _NORM_OF:  # the pointwise function over the pieces, then their norms
            pointwise, lists = args[0], args[1:]
            parts = [long_norm(v) for v in pointwise(*[pieces(xs) for xs in lists])]
        elif kind == _NORM:
            xs = args[0]
            big = [xs[i] for i in alone]
            if big and all(t.dtype in (torch.float32, torch.float64) and t.numel() <= LONG_CHUNK for t in big):
                parts = list(torch._foreach_norm(big))
            else:
                parts = [long_norm(t.reshape(-1)) for t in big]  # (fp16/bf16 widened inside the kernel, no copy)
            parts += [torch.linalg.vector_norm(flat(xs, k)) for k in range(len(chunks))]
        else:
            xs, ys = args
            parts = [long_dot(_wide(xs[i]), _wide(ys[i]).to(_wide(xs[i]).dtype)) for i in alone]
            parts += [long_dot(flat(xs, k), flat(ys, k).to(flat(xs, k).dtype)) for k in range(len(chunks))]
            results.append(total(parts).sum() if len(parts) > 1 else parts[0].double().to(device))
            continue
        results.append(total(parts).square().sum())
    return torch.stack(results)


def global_norm(tensors: Tensors, plan: Optional[List[List[int]]] = None, layout=None) -> torch.Tensor:
    """One L2 norm over every tensor of the list (a 0-dim float64 tensor, no host sync)."""
    return Sums().norm("norm", list(tensors)).reduce(plan, layout=layout)[0]


def dot(xs: Tensors, ys: Tensors, plan: Optional[List[List[int]]] = None, layout=None) -> torch.Tensor:
    """Inner product ``<xs, ys>`` over all tensors, as a 0-dim float64 tensor (no host sync)."""
    xs, ys = list(xs), list(ys)
    if not xs and (layout is None or not layout.collective):
        return torch.zeros((), dtype=torch.float64)
    return Sums().inner("inner", xs, ys).reduce(plan, layout=layout)[0]
