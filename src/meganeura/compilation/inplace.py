"""In-place passes over the fused kernels: updates written straight into their parameter's
or state's buffer, and f16 copies stored by the kernel that writes their master value."""
from __future__ import annotations

from ..memplan import move_value, reads_only_own_element, touching_units

def update_in_place(kernels, sched, targets, updates) -> int:
    """A new value of a parameter or state computed elementwise from the old one (an
    optimizer update, a KV-cache blend) is written straight into the tensor's buffer, when
    nothing after its writer reads the old value: no copy after the step and no second
    buffer of that size. Returns how many updates became in place."""
    named = {b.name: b for b in sched.bufs if b.kind in ("parameter", "state")}
    touching = touching_units(kernels)
    values: dict = {}            # buffer id -> the schedule's value views on it (target locations)
    for x in sched.values.values():
        values.setdefault(id(x.buf), []).append(x)
    done = 0
    for ti, name in updates.items():
        v = sched.values.get(targets[ti].id)
        dst = named.get(name)
        if v is None or dst is None or v.buf.kind != "target" or v.offset or not v.is_contiguous() \
                or v.buf.nbytes != dst.nbytes or v.dtype is not dst.dtype:
            continue
        # each writer with the view it writes this value by (a further output may be a transpose)
        writers = [(i, u, wv) for i, u in touching.get(id(v.buf), [])
                   if (wv := next((o for o in [u.out, *u.outs] if o.buf is v.buf), None)) is not None]
        if len(writers) != 1:
            continue
        wi, w, written = writers[0]
        # the writer reads the old value only at the element it writes, and nothing else
        # touches the old value from the writer's launch on
        if not reads_only_own_element(w, dst, written) \
                or any(i >= wi and u is not w for i, u in touching.get(id(dst), [])):
            continue
        move_value(touching, v.buf, dst)
        for x in values.pop(id(v.buf), []):
            x.buf = dst
        done += 1
    return done


def _is_copy_cast(k, copies) -> bool:
    """``k`` casts one whole value into an f16 copy named in ``copies``."""
    e = k.spec.get("expr")
    return k.archetype == "pointwise" and k.out.buf.name in copies and len(k.reads) == 1 and not k.epi_reads \
        and e is not None and e[0] == "op" and e[1].op == "cast" and e[2] == [("leaf", 0)] \
        and k.out.is_contiguous() and k.reads[0].is_contiguous() and k.epilogue is None


def _n_bindings(k) -> int:
    return len({id(v.buf) for v in k.read_views()} | {id(b) for b in k.written_bufs()})


def store_copies_with_writers(kernels, copies, max_bindings=8) -> list:
    """An f16 copy computed from a value that a pointwise kernel (or part) wrote earlier
    becomes a second store of that writer (``spec["stores"]``): the optimizer's update
    writes the master weight and its f16 copy in one pass, and the cast's launch goes.
    Only when nothing touches the value or the copy between the two, and the writer's
    launch has a binding left."""
    writer: dict = {}        # id(buf) -> (launch position, its kernel, pointwise unit that last wrote it whole)
    last: dict = {}          # id(buf) -> last launch position that read or wrote it
    out = []
    for i, k in enumerate(kernels):
        units = k.spec.get("parts", [k]) if k.archetype == "multi" else [k]
        kept = []
        for u in units:
            src = u.reads[0] if _is_copy_cast(u, copies) else None
            w = writer.get(id(src.buf)) if src is not None else None
            if w is not None and w[2].out.offset == src.offset and w[2].out.shape == src.shape \
                    and last.get(id(src.buf)) == w[0] and last.get(id(u.out.buf), -1) < w[0] \
                    and _n_bindings(w[1]) < max_bindings:
                w[2].spec = {**w[2].spec, "stores": [*w[2].spec.get("stores", []), u.out]}
                last[id(u.out.buf)] = w[0]
                continue
            kept.append(u)
        for u in kept:
            for v in list(u.reads) + list(u.epi_reads):
                last[id(v.buf)] = i
            for b in u.written_bufs():
                last[id(b)] = i
                writer.pop(id(b), None)
            if u.archetype == "pointwise" and u.epilogue is None and u.out.is_contiguous() \
                    and u.out.size * u.out.dtype.np.itemsize == u.out.buf.nbytes:
                writer[id(u.out.buf)] = (i, k, u)
        if not kept:
            continue
        if k.archetype == "multi" and len(kept) != len(units):
            k.spec = {**k.spec, "parts": kept}
            k.name = "|".join(u.name for u in kept)
        out.append(k)
    return out
