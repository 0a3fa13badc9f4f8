"""The formulas of the clipping engine, one small function each.

Every weight gradient the engine handles without materializing it has, for example i, the form

    G_i = sum_t u_{i,t} v_{i,t}^T        u_{i,t} in R^P (row side), v_{i,t} in R^Q (column side)

(a Linear layer: u = grad output, v = input, t = position; a convolution after unfolding; an
Embedding: u = one-hot token, v = grad output). A "factor" is the pair (u, v) stored as tensors
of shape (B, G, T, P) and (B, G, T, Q), with G independent blocks (convolution groups; 1
otherwise); either side (not both) may instead be a :class:`OneHot` (token ids, shape (B, G, T)):
the row side for an Embedding table (V, d), the column side for a table stored transposed
(peft's LoRA ``lora_embedding_A``, (r, V)).

* ghost norm (Li et al. 2022, "Large language models can be strong differentially private
  learners", Sec. 4): ||G_i||_F^2 = sum_{t,t'} (u_t . u_t') (v_t . v_t'), cost O(T^2 (P + Q)),
  never forming the P x Q matrix;
* book-keeping (Bu et al., ICML 2023, "Differentially private optimization on large model at
  small cost", Sec. 3): sum_i c_i G_i = U^T diag(c) V as one product over the stacked
  (example, position) rows, reusing the captured tensors instead of a second backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..per_example import clip_factors

__all__ = [
    "as_dtype",
    "OneHot",
    "GHOST_RATIO",
    "use_ghost",
    "one_hot_side",
    "gram",
    "one_hot_norm_sq",
    "ghost_norm_sq",
    "shared_input_products",
    "bookkeeping_sum",
    "materialize",
    "clip_weights",
]


@dataclass
class OneHot:
    """One-hot rows given by their indices: ``idx`` (B, G, T) int64 into range(size)."""

    idx: torch.Tensor
    size: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.idx.shape, self.size)

    @property
    def device(self) -> torch.device:
        return self.idx.device


def _t(x) -> int:
    return x.shape[2]


#: what one element of a materialized per-example gradient costs, in multiply-adds, summed over its
#: three memory passes (written by the per-example product, read for its norm, read again for the
#: weighted sum). Dense factors take the ghost norm iff T^2 (P + Q) <= GHOST_RATIO * P Q.
#: Calibrated on the shared 2-core CPU (benchmarks/bench_ghost_ratio.py: whole private steps of
#: GPT-2 / BERT configs against a plain step in one process, 1 thread, B = 32, ratios 2 to 128;
#: RESULTS.md "Materialize or ghost norm"). At T = 64 and width 128 (every Linear materialized,
#: as before) 32 is within the noise of the best; at widths 256-768 it beats the multiply-add
#: count alone (ratio 2) by 0.04-0.12 of a plain step. Larger ratios gain up to 0.1 more at
#: widths >= 512 but put GPT-2's 128 x 384 c_attn on the ghost norm, 0.05-0.12 slower.
GHOST_RATIO = 32


def use_ghost(total_t: int, p: int, q: int, one_hot: bool = False) -> bool:
    """Per-parameter rule: ghost norm, or the per-example gradients materialized (and held for the
    clipped sum), whichever costs less.

    Dense factors (B, G, T, P) and (B, G, T, Q), per example and block: the ghost norm forms two
    T x T Gram matrices, T^2 (P + Q) multiply-adds, and the clipped sum then needs the book-keeping
    product U^T diag(c) V, T P Q; materializing costs the same T P Q once, and then each of its
    P Q elements goes through memory three times (written, read for the norm, read for the
    weighted sum), each pass worth many multiply-adds on a CPU once B P Q floats leave the cache.
    Hence ghost iff T^2 (P + Q) <= :data:`GHOST_RATIO` P Q (measured constant). T = 1 (a Linear
    on (B, d)) always takes the ghost norm: ||G_i||^2 = ||u_i||^2 ||v_i||^2; a Linear on sequences
    takes materialization once T^2 (P + Q) / (P Q) exceeds the ratio: T = 64 at width 128, but
    only T > 90 at width 512. The engine still takes the ghost norm where holding the materialized
    gradients would exceed its memory budget (:meth:`.engine.ClippingEngine.clipped_sum`).

    ``one_hot`` (every use of the parameter has its one-hot side on the same side,
    :func:`one_hot_side`: an Embedding, P or Q = vocabulary size): always the norm without the
    table, :func:`one_hot_norm_sq`, each example's rows summed by token: one pass over the B T
    dense rows, as the ``index_add`` that materializing starts with, before materializing's B V Q
    tables are zeroed, normed and summed. A table with a dense use as well (tied to an LM head)
    pays that use's dense Gram matrices and book-keeping product, and one looked up on both sides
    (a square table) T x T Gram matrices, so both follow the dense rule. T is the total number of
    rows over every use of the parameter (a layer called twice, tied weights), since all uses
    enter one norm.
    """
    if one_hot:
        return True
    return total_t * total_t * (p + q) <= GHOST_RATIO * p * q


def one_hot_side(factors: list[tuple[object, torch.Tensor]]) -> int | None:
    """0 if every use of a parameter has its :class:`OneHot` on the row side (an Embedding's table),
    1 if every use has it on the column side (a table stored transposed, peft's ``lora_embedding_A``),
    None otherwise (a dense use, or one-hot sides that differ between uses): not None is the one-hot
    rule of :func:`use_ghost` and :func:`one_hot_norm_sq`."""
    sides = {0 if isinstance(u, OneHot) else 1 if isinstance(v, OneHot) else None for u, v in factors}
    return sides.pop() if len(sides) == 1 else None


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``: ``x`` itself when it already is. ``Tensor.to`` returns the same tensor
    then too, but it is still an operator call, and a GPU step waits on the host's calls
    (benchmarks/RESULTS.md, operator calls per step)."""
    return x if x.dtype == dtype else x.to(dtype)


def gram(x, y) -> torch.Tensor:
    """Gram matrix (B, G, T_x, T_y) of the rows of two factor sides (dense or :class:`OneHot`).

    One-hot against one-hot is token equality, one-hot against dense is a gather (the dense
    row's entry at the token), so an Embedding never forms its V-dimensional rows.
    """
    if isinstance(x, OneHot) and isinstance(y, OneHot):
        return (x.idx.unsqueeze(-1) == y.idx.unsqueeze(-2)).to(torch.get_default_dtype())
    if isinstance(x, OneHot):
        return gram(y, x).transpose(-1, -2)
    if isinstance(y, OneHot):
        b, g, tx, _ = x.shape
        idx = y.idx.unsqueeze(-2).expand(b, g, tx, y.idx.shape[-1])
        return torch.gather(x, -1, idx)
    if x.shape[2] == 1 and y.shape[2] == 1:
        return (x * y).sum(-1, keepdim=True)  # T = 1: (B, G, 1, 1) without a matmul
    return torch.matmul(x, y.transpose(-1, -2))


def _cat_rows(sides: list) -> object:
    if isinstance(sides[0], OneHot):
        return OneHot(torch.cat([s.idx for s in sides], dim=2), sides[0].size)
    return torch.cat(sides, dim=2) if len(sides) > 1 else sides[0]


def ghost_norm_sq(factors: list[tuple[object, torch.Tensor]]) -> torch.Tensor:
    """Per-example ||sum_k G_i^(k)||_F^2 over all uses k of one parameter, (B,), by ghost norm.

    Li et al. 2022: ||sum_t u_t v_t^T||^2 = sum_{t,t'} (u_t . u_t')(v_t . v_t'). Uses of the
    same kind are stacked along T (their cross terms are then inside one Gram matrix); a dense
    and a one-hot group meet in the cross term counted twice. Clamped at 0 against rounding
    (a NaN stays NaN).
    """
    if one_hot_side(factors) is not None:
        return one_hot_norm_sq(factors)
    groups: dict[tuple[bool, bool], list] = {}
    for u, v in factors:
        groups.setdefault((isinstance(u, OneHot), isinstance(v, OneHot)), []).append((u, v))
    stacked = [(_cat_rows([u for u, _ in fs]), _cat_rows([v for _, v in fs])) for fs in groups.values()]
    total = None
    for a in range(len(stacked)):
        for b in range(a, len(stacked)):
            (u1, v1), (u2, v2) = stacked[a], stacked[b]
            gu, gv = gram(u1, u2), gram(v1, v2)
            if gu.dtype != gv.dtype:  # a one-hot Gram (0/1) takes the dense side's dtype
                dt = torch.promote_types(gu.dtype, gv.dtype)
                gu, gv = gu.to(dt), gv.to(dt)
            term = (gu * gv).sum(dim=(1, 2, 3))
            term = term if a == b else 2 * term
            total = term if total is None else total + term
    return total.clamp(min=0.0)


def one_hot_norm_sq(factors: list[tuple[object, torch.Tensor]]) -> torch.Tensor:
    """Per-example ||G_i||_F^2, (B,), of a table whose every use has its :class:`OneHot` on the same
    side (:func:`one_hot_side`), without a T x T Gram matrix.

    Row w of G_i in block g (a column, for a one-hot column side) is s_{i,g,w}, the sum of the dense
    rows d_{i,g,t} of every use at the positions t with token w, so ||G_i||^2 = sum_{g,w}
    ||s_{i,g,w}||^2: the ghost norm sum_{t,t'} [w_t = w_t'] (d_t . d_t') of :func:`ghost_norm_sq`
    with its sums taken in the other order, O(B T Q) instead of O(B T^2 Q). The rows are grouped by
    sorting their keys (example, block, token), with no size read back to the host (no GPU sync):
    segment k of the sorted keys is row k of a buffer of all the rows (the unused ones stay zero).
    A sum of squares, so no clamp; a NaN row reaches only its own example's norm.
    """
    side = one_hot_side(factors)
    pairs = [(u, v) if side == 0 else (v, u) for u, v in factors]  # (one-hot, dense) per use
    d0 = pairs[0][1]
    b, g, q, size = d0.shape[0], d0.shape[1], d0.shape[-1], pairs[0][0].size
    if b > 1 and all(oh.idx.stride(0) == 0 for oh, _ in pairs):
        return _shared_one_hot_norm_sq(pairs)
    small = size <= sum(d.shape[2] for _, d in pairs)
    if not small and d0.device.type == "cpu":
        sq = _pairs_norm_sq(pairs)
        if sq is not None:
            return sq
    offsets = torch.arange(b * g, device=d0.device).view(b, g, 1) * size
    keys = torch.cat([(oh.idx + offsets).reshape(-1) for oh, _ in pairs])
    rows = torch.cat([d.reshape(-1, q) for _, d in pairs]) if len(pairs) > 1 else d0.reshape(-1, q)
    if small:
        # a table no longer than the uses' tokens (BERT's 2 token types): every example's whole
        # table is no larger than its rows, so they go straight to (example, block, token) without
        # a sort (BERT's step at width 128, B 32, T 64: 133 -> 62-73 us)
        tables = torch.zeros(b * g * size, q, dtype=rows.dtype, device=rows.device).index_add_(0, keys, rows)
        return torch.linalg.vector_norm(tables.view(b, -1), dim=1).square()
    ordered, perm, starts = _segments(keys)
    segment = starts.cumsum(0) - 1  # the segment of each sorted key
    where = torch.empty_like(segment).scatter_(0, perm, segment)  # the segment of each row
    sums = torch.zeros(rows.shape, dtype=rows.dtype, device=rows.device).index_add_(0, where, rows)
    example = torch.zeros_like(segment).scatter_(0, segment, ordered // (g * size))
    sq = torch.linalg.vector_norm(sums, dim=1).square()
    return torch.zeros(b, dtype=rows.dtype, device=rows.device).index_add_(0, example, sq)


#: :func:`_pairs_norm_sq` is taken while the examples' key comparisons (B N^2 for N rows an example)
#: are at most this many (4 MB of booleans)
PAIRS_MAX_COMPARISONS = 1 << 22


def _pairs_norm_sq(pairs: list[tuple[OneHot, torch.Tensor]]) -> torch.Tensor | None:
    """:func:`one_hot_norm_sq` by its ghost form with the sums in the third order: ||G_i||^2 =
    sum_t ||d_t||^2 + 2 sum_{t < t', same (block, token)} d_t . d_t' (Li et al. 2022's
    sum_{t,t'} [w_t = w_t'] d_t . d_t', its diagonal and its equal-key pairs, each pair once).
    On CPU, where reading the pairs' count back costs no device sync: one pass over the rows and a
    few gathered products where tokens repeat rarely (a vocabulary), instead of summing every row
    into its segment (BERT's word embedding in its step at width 128, B 32, T 64, 500 tokens:
    428 -> 278 us). None (the caller sums the segments) where the comparisons exceed
    :data:`PAIRS_MAX_COMPARISONS` or equal-key pairs outnumber the rows (padding repeated).
    Clamped at 0 against rounding (a NaN stays NaN, in its own example)."""
    d0 = pairs[0][1]
    b, g, q, size = d0.shape[0], d0.shape[1], d0.shape[-1], pairs[0][0].size
    n = sum(g * d.shape[2] for _, d in pairs)
    if b * n * n > PAIRS_MAX_COMPARISONS:
        return None
    blocks = torch.arange(g, device=d0.device).view(1, g, 1) * size
    keys = torch.cat([(oh.idx + blocks).reshape(b, -1) for oh, _ in pairs], dim=1) if len(pairs) > 1 \
        else (pairs[0][0].idx + blocks).reshape(b, -1)
    same = (keys.unsqueeze(2) == keys.unsqueeze(1)).triu_(1)
    ex, t1, t2 = same.nonzero(as_tuple=True)
    if ex.numel() > b * n:
        return None
    rows = torch.cat([d.reshape(b, -1, q) for _, d in pairs], dim=1) if len(pairs) > 1 else d0.reshape(b, -1, q)
    sq = torch.linalg.vector_norm(rows.reshape(b, -1), dim=1).square()
    if ex.numel():
        sq.index_add_(0, ex, (rows[ex, t1] * rows[ex, t2]).sum(-1), alpha=2.0)
    return sq.clamp_(min=0.0)


def _segments(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys sorted, the permutation that sorts them, whether each sorted key starts a segment of
    equal keys)."""
    ordered, perm = keys.sort()
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    return ordered, perm, starts


def _shared_one_hot_norm_sq(pairs: list[tuple[OneHot, torch.Tensor]]) -> torch.Tensor:
    """:func:`one_hot_norm_sq` for indices shared by the batch (expanded (1, T) position ids, stride
    0 along the batch): the segments of equal (block, token) keys are the same in every example,
    so they are found once on the G T keys of example 0, and each example's rows are summed into
    them along dim 1 (on CPU, keys all distinct: the norm of the rows themselves). Measured in
    BERT's step at width 128 (B 32, T 64), position ids: 202-210 -> 79 us."""
    d0 = pairs[0][1]
    b, g, q, size = d0.shape[0], d0.shape[1], d0.shape[-1], pairs[0][0].size
    blocks = torch.arange(g, device=d0.device).view(g, 1) * size
    keys = torch.cat([(oh.idx[0] + blocks).reshape(-1) for oh, _ in pairs])
    rows = torch.cat([d.reshape(b, -1, q) for _, d in pairs], dim=1) if len(pairs) > 1 else d0.reshape(b, -1, q)
    _, perm, starts = _segments(keys)
    if rows.device.type == "cpu" and bool(starts.all()):
        # every key its own segment (positions 0..T-1): each table row is one row of d (read back to
        # the host on CPU only, where it costs no sync)
        return torch.linalg.vector_norm(rows.reshape(b, -1), dim=1).square()
    where = torch.empty_like(perm).scatter_(0, perm, starts.cumsum(0) - 1)  # the segment of each key
    sums = torch.zeros(rows.shape, dtype=rows.dtype, device=rows.device).index_add_(1, where, rows)
    return torch.linalg.vector_norm(sums.view(b, -1), dim=1).square()


def bookkeeping_sum(factors: list[tuple[object, torch.Tensor]], weights: torch.Tensor, shape) -> torch.Tensor:
    """sum_i w_i sum_k G_i^(k), reshaped to the parameter's ``shape`` (Bu et al. 2023, book-keeping).

    One contraction over (example, position) per use: U^T diag(w) V; a one-hot side becomes an
    ``index_add`` of the weighted rows of the other side into the table (transposed back for a
    one-hot column side).
    """
    out = None
    for u, v in factors:
        if isinstance(v, OneHot):  # G_i^T = sum_t v_t u_t^T: the one-hot row rule, transposed
            s = bookkeeping_sum([(v, u)], weights, (u.shape[1], v.size, u.shape[-1])).transpose(-1, -2)
            out = s.reshape(shape) if out is None else out + s.reshape(shape)
            continue
        b, g, t, q = v.shape
        shared = isinstance(u, OneHot) and b > 1 and u.idx.stride(0) == 0
        if not shared and (isinstance(u, OneHot) or g != 1 or u.shape[-1] >= q):
            wv = v * as_dtype(weights, v.dtype).view(b, 1, 1, 1)
        if shared:
            # indices shared by the batch (expanded position ids): sum_i w_i v_i first, then its
            # G T rows into the table (the B G T rows would all be added into the same few)
            rows = (u.idx[0] + torch.arange(g, device=v.device).view(g, 1) * u.size).reshape(-1)
            s = torch.zeros(g * u.size, q, dtype=v.dtype, device=v.device)
            s.index_add_(0, rows, torch.mv(v.reshape(b, -1).t(), as_dtype(weights, v.dtype)).view(-1, q))
        elif isinstance(u, OneHot):
            rows = (u.idx + torch.arange(g, device=v.device).view(1, g, 1) * u.size).reshape(-1)
            s = torch.zeros(g * u.size, q, dtype=v.dtype, device=v.device)
            s.index_add_(0, rows, wv.reshape(-1, q))
        elif g == 1:
            # one plain matmul over the stacked (example, position) rows; the weights go on the
            # narrower side
            if u.shape[-1] < q:
                s = torch.mm((u * as_dtype(weights, u.dtype).view(b, 1, 1, 1)).reshape(b * t, -1).t(), v.reshape(b * t, q))
            else:
                s = torch.mm(u.reshape(b * t, -1).t(), wv.reshape(b * t, q))
        else:
            s = torch.einsum("bgtp,bgtq->gpq", u, wv)
        out = s.reshape(shape) if out is None else out + s.reshape(shape)
    return out


def materialize(factors: list[tuple[object, torch.Tensor]], shape, out: torch.Tensor | None = None) -> torch.Tensor:
    """The per-example gradients sum_k G_i^(k), shape (B, *shape) (where :func:`use_ghost` says so).

    ``out``: B * prod(shape) contiguous numbers of the factors' dtype that the first use is written
    into (the engine's workspace, kept between steps); the result is then a view of it.
    """
    # dense uses first: the first is written into ``out``, a one-hot row use is then added into it
    # in place (a table tied to an LM head); a single use may come back transposed
    factors = sorted(factors, key=lambda f: isinstance(f[0], OneHot) or isinstance(f[1], OneHot))
    full = None
    for u, v in factors:
        if full is not None and isinstance(u, OneHot) and full.is_contiguous():
            _one_hot_rows_add(full.view(-1, v.shape[-1]), u, v)
            continue
        s = _materialize_use(u, v, shape, out if full is None else None, transposed=len(factors) == 1)
        full = s if full is None else full.add_(s)
    return full


def _materialize_use(u, v, shape, out: torch.Tensor | None, transposed: bool = True) -> torch.Tensor:
    """One use's (B, *shape) per-example gradients, written into ``out`` where its dtype fits;
    ``transposed``: the layout of :func:`per_example_products` may be taken (only for a matrix
    parameter: a convolution's (B, out, in, k...) view of a transposed product has no (B, N) rows
    in storage order, so the engine's norm and weighted sum would each copy it)."""
    if isinstance(v, OneHot):  # one-hot column side: the one-hot row rule, transposed
        b, g = u.shape[:2]
        return _materialize_use(v, u, (g, v.size, u.shape[-1]), out).transpose(-1, -2).reshape(b, *shape)
    b, g, t, q = v.shape
    if out is not None and (out.dtype != v.dtype or (not isinstance(u, OneHot) and u.dtype != v.dtype)):
        out = None
    if isinstance(u, OneHot):
        s = (torch.zeros(b * g * u.size, q, dtype=v.dtype, device=v.device) if out is None
             else out.view(b * g * u.size, q).zero_())
        _one_hot_rows_add(s, u, v)
    elif g == 1:
        s = per_example_products(u[:, 0], v[:, 0], out, transposed and len(shape) == 2).unsqueeze(1)
    else:
        s = torch.einsum("bgtp,bgtq->bgpq", u, v)
    return s.reshape(b, *shape)


def _one_hot_rows_add(rows: torch.Tensor, u: OneHot, v: torch.Tensor) -> None:
    """rows (B * G * V, Q) += each example's and block's one-hot rule: row (i, g, token) gets v_t."""
    b, g, _, q = v.shape
    offs = (torch.arange(b, device=v.device).view(b, 1, 1) * g
            + torch.arange(g, device=v.device).view(1, g, 1)) * u.size
    rows.index_add_(0, (u.idx + offs).reshape(-1), v.reshape(-1, q).to(rows.dtype))


def per_example_products(u: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None,
                         transposed: bool = True) -> torch.Tensor:
    """(B, P, Q) = u_i^T v_i for u (B, T, P), v (B, T, Q): each example's sum_t u_t v_t^T.

    One batched product whose output rows are the longer of P, Q: a narrow output row (a LoRA B
    factor's P x r) runs slower in the batched matmul than its transpose (measured on CPU, B = 32,
    T = 64: P x 8 = 128 x 8 85 vs 30 us, 768 x 8 540 vs 313 us; at Q >= 16 the two are within
    10%). So P > Q computes v_i^T u_i and returns its transposed view, (B, P, Q) with (B, Q, P)
    storage: a transposing copy would cost more than it saves (2.2 ms against 1.0 ms at
    256 x 128), and the engine reads such a gradient in storage order (``_storage_rows``).
    ``out``: B P Q contiguous numbers to write the product into; ``transposed=False``: always the
    (B, P, Q) storage (a gradient that other uses are added into).
    """
    b, p, q = u.shape[0], u.shape[-1], v.shape[-1]
    if transposed and p > q:
        dst = None if out is None else out.view(b, q, p)
        return torch.bmm(v.transpose(1, 2), u, out=dst).transpose(1, 2)
    return torch.bmm(u.transpose(1, 2), v, out=None if out is None else out.view(b, p, q))


def shared_input_products(us: list[torch.Tensor], v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(B, sum_k U_k, V): example i's per-example products u_k,i^T v_i of uses that share their
    column side v (B, 1, T, V), stacked along the rows: [u_1 .. u_K]^T v = [u_1^T v; ..; u_K^T v]
    per example, one batched product instead of K (rows k of the result are use k's (U_k, V)
    gradient). ``us``: the (B, 1, T, U_k) row sides; ``out``: B * sum U_k * V contiguous numbers."""
    stacked = torch.cat([u[:, 0] for u in us], dim=-1)
    b, rows, cols = v.shape[0], stacked.shape[-1], v.shape[-1]
    return torch.bmm(stacked.transpose(1, 2), v[:, 0], out=None if out is None else out.view(b, rows, cols))


def clip_weights(norms: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """c_i = min(1, zeta / ||g_i||) (tutorial Eq. 1.3; Abadi et al. 2016), 0 for a non-finite norm.

    Same formula as :func:`corrnoise.torch.per_example.clip_factors` (1 for a zero gradient);
    an example whose gradient is NaN/inf contributes zero (its zero-out neighbour), so a NaN
    never reaches the released sum.
    """
    factors = clip_factors(norms, clip_norm)
    return torch.where(torch.isfinite(norms), factors, torch.zeros_like(factors))
