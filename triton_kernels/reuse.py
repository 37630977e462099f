"""Selection reuse (QuestConfig(reselect_every=k), as in LServe): the pages a decode step attends when pages are
chosen every `k` steps, and the device state that carries the choice between steps.

State (device tensors, updated in place so a captured step replays it): `stored` int32 `[B, H_kv, K]` the last
chosen selection (ascending, the spare page last, then -1), `since` int64 `[]` the position it was chosen at,
`step` int64 `[]` decode steps since then, `due` int32 `[]` whether this step chooses (read by `score_pages(due=)`
and `topk_pages(due=)` before this runs: on a reusing step both launches return at once, so `fresh` is then
unwritten, and is read only where due). One step:

    stored = fresh where due                       (fresh: this step's Top-K; unwritten on a reusing step, unread)
    c0 = (since - 1) // S, since = pos where due   (c0: the page that was current when `stored` was chosen)
    out = stored less the spare page, then pages c0 + 1 .. cur (started since: empty then, so never in `stored`),
          then the spare page, then -1             ([B, H_kv, K + E], E = ceil((k - 1) / S): at most E new pages)
    step += 1, due = (step % k == 0)               (for the next step)

One program a row; the shared scalars are written by the last program to finish (an atomic ticket, one int32 the
state keeps zeroed), after every program has read them, so none sees the next step's state.
"""
import torch

from ._common import next_pow2, require_triton, tl, triton

__all__ = ["reuse_pages", "reuse_pages_ref", "extra_pages"]


def extra_pages(every: int, page_size: int) -> int:
    """Pages a KV head can start between two selections `every` steps apart: `ceil((every - 1) / S)`."""
    return -(-(every - 1) // page_size)


def _check(fresh, stored, since, step, due, pos, every, ticket=None):
    if ticket is not None and (ticket.numel() != 1 or ticket.dtype != torch.int32 or ticket.device != fresh.device):
        raise ValueError(f"ticket must be one zeroed int32 element on {fresh.device}, got {ticket.dtype} "
                         f"{tuple(ticket.shape)} on {ticket.device}")
    if fresh.dtype != torch.int32 or fresh.dim() != 3 or stored.shape != fresh.shape or stored.dtype != torch.int32:
        raise ValueError(f"fresh and stored must be int32 [B, H_kv, K] of one shape, got {fresh.dtype} "
                         f"{tuple(fresh.shape)} and {stored.dtype} {tuple(stored.shape)}")
    for name, t, dt in (("since", since, torch.int64), ("step", step, torch.int64), ("due", due, torch.int32),
                        ("pos", pos, None)):
        if t.numel() != 1 or t.device != fresh.device or (dt is not None and t.dtype != dt):
            raise ValueError(f"{name} must be one {dt or 'integer'} element on {fresh.device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    if not isinstance(every, int) or every < 2:
        raise ValueError(f"every must be an int >= 2 (1 is no reuse), got {every!r}")


def reuse_pages_ref(fresh, stored, since, step, due, pos, page_size: int, every: int, ticket=None):
    """One reuse step (module docstring), in place on `stored/since/step/due`; returns int32 `[B, H_kv, K + E]`
    ascending, -1 last. Device ops only (no host sync). `ticket`: the kernel's counter (left at 0; unused here)."""
    _check(fresh, stored, since, step, due, pos, every, ticket)
    S, E = page_size, extra_pages(every, page_size)
    now = due.view(()) != 0
    stored.copy_(torch.where(now, fresh, stored))
    c0 = torch.div(torch.where(now, pos.view(()).long(), since) - 1, S, rounding_mode="floor")
    since.copy_(torch.where(now, pos.view(()).long(), since))
    cur = torch.div(pos.view(()).long() - 1, S, rounding_mode="floor")
    new = c0 + 1 + torch.arange(E, device=fresh.device)
    new = torch.where(new <= cur, new, -1).to(torch.int32).expand(*fresh.shape[:2], E)
    out = torch.cat([stored, new], -1)
    big = torch.iinfo(torch.int32).max  # -1 sorts last, the chosen ids ascending
    out = torch.where(out < 0, big, out).sort(-1).values
    step.add_(1)
    due.copy_((step % every == 0).to(torch.int32))
    return torch.where(out == big, -1, out)


@triton.jit
def _reuse_pages_kernel(
    fresh_ptr, stored_ptr, out_ptr, since_ptr, step_ptr, due_ptr, pos_ptr, ticket_ptr,
    stride_fr, stride_fk, stride_sr, stride_sk, stride_or, stride_ok,
    R, K,
    PAGE: tl.constexpr, EVERY: tl.constexpr, E: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    due = tl.load(due_ptr) != 0
    pos = tl.load(pos_ptr).to(tl.int64)
    since = tl.load(since_ptr)
    c0 = (tl.where(due, pos, since) - 1) // PAGE
    cur = (pos - 1) // PAGE
    e = tl.minimum(tl.maximum(cur - c0, 0), E)  # new pages started since the selection
    o_j = tl.arange(0, BLOCK)
    m_in = o_j < K
    b_old = tl.load(stored_ptr + r * stride_sr + o_j * stride_sk, mask=m_in, other=-1)
    # A reusing step's Top-K returned without writing `fresh` (topk_pages(due=)): read only where due.
    b_new = tl.load(fresh_ptr + r * stride_fr + o_j * stride_fk, mask=o_j < tl.where(due, K, 0), other=-1)
    b_ids = tl.where(due, b_new, b_old)
    tl.store(stored_ptr + r * stride_sr + o_j * stride_sk, b_ids, mask=m_in)
    n = tl.sum((b_ids >= 0).to(tl.int32), axis=0)  # valid ids; the last one is the spare page (always chosen)
    spare = tl.max(b_ids, axis=0)
    b_out = tl.where(o_j < n - 1, b_ids, -1)
    b_out = tl.where((o_j >= n - 1) & (o_j < n - 1 + e), (c0 + 1 + (o_j - (n - 1))).to(tl.int32), b_out)
    b_out = tl.where(o_j == n - 1 + e, spare, b_out)
    tl.store(out_ptr + r * stride_or + o_j * stride_ok, b_out, mask=o_j < K + E)
    # Every program read the scalars above before its ticket (the atomic's release); the last one writes them.
    tl.debug_barrier()
    i_ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if i_ticket == R - 1:
        tl.store(since_ptr, tl.where(due, pos, since))
        step = tl.load(step_ptr) + 1
        tl.store(step_ptr, step)
        tl.store(due_ptr, (step % EVERY == 0).to(tl.int32))
        tl.store(ticket_ptr, 0)


def reuse_pages(fresh, stored, since, step, due, pos, page_size: int, every: int, ticket=None):
    """Triton twin of `reuse_pages_ref`: one program a `[B * H_kv]` row. `ticket`: a zeroed int32 element the
    kernel leaves at 0 (the layer keeps one; None: a fresh one, one more small launch)."""
    require_triton()
    _check(fresh, stored, since, step, due, pos, every, ticket)
    if ticket is None:
        ticket = torch.zeros((), dtype=torch.int32, device=fresh.device)
    B, H, K = fresh.shape
    E = extra_pages(every, page_size)
    out = torch.empty(B, H, K + E, dtype=torch.int32, device=fresh.device)
    f, s, o = fresh.reshape(B * H, K), stored.view(B * H, K), out.view(B * H, K + E)
    _reuse_pages_kernel[(B * H,)](
        f, s, o, since, step, due, pos, ticket,
        f.stride(0), f.stride(1), s.stride(0), s.stride(1), o.stride(0), o.stride(1),
        B * H, K,
        PAGE=page_size, EVERY=every, E=E, BLOCK=max(16, next_pow2(K + E)), num_warps=4,
    )
    return out
