"""Data-parallel training throughput: SmolLM2-135M on N GPUs (mg.distributed) against one.

    torchrun --standalone --nproc_per_node 2 bench/data_parallel.py --size real
    torchrun --standalone --nproc_per_node 2 bench/data_parallel.py --size real --backend wgpu --out /tmp/dp-wgpu
    torchrun --standalone --nproc_per_node 2 bench/data_parallel.py --size tiny --out /tmp/dp    # smoke test
    torchrun --standalone --nproc_per_node 2 bench/data_parallel.py --size real --grad-path host  # the copies

For each accumulation (``--accumulate``, default 1,4,16): rank 0 first trains alone with
an ordinary session (forward, backward and update in one submit per micro-step, AdamW) while
the other ranks wait, then every rank trains with ``mg.distributed.compile`` on its own
micro-batch of ``--batch`` sequences of ``--seq`` tokens; both on the runtime that
``--backend`` names (``gpu``: the direct Vulkan backend where it runs, else wgpu; the report
says which ran). Throughput is tokens per second
over whole updates (accumulate micro-steps and one update; N GPUs process N times the
tokens per update). The breakdown is host seconds per update by stage, as the session
measures it (compute = waiting for the GPU, readback = copying gradients out of mapped
memory into host arrays, allreduce = waiting for Gloo beyond what overlapped, upload =
handing the sums to the runtime's input upload, update = the update phase, with the copies
of the sums from staging into device memory where they ride in its command buffer);
``allreduce alone`` times the same buckets all-reduced with nothing else running: the
communication that overlap has to hide.

``--streams`` (comma-separated, default: the library's default, 4, or
``$MEGANEURA_DP_STREAMS``) sets how many all-reduces run at once, each on a Gloo process
group of its own (``mg.distributed.init(streams=)``); every accumulation is timed with
each count, and ``allreduce alone`` uses the session's own streams and pieces.
``--gloo-only`` skips the model: it all-reduces ``--gloo-mb`` MiB of float32 (default 513,
SmolLM2's gradients) in buckets of ``--bucket-mb`` (default 25) with each stream count,
both whole buckets round-robin over the streams and buckets split over them as the
session does, and reports the bandwidth (``gloo_streams.json`` / ``.md``)::

    GLOO_SOCKET_IFNAME=lo torchrun --standalone --nproc_per_node 2 bench/data_parallel.py --gloo-only \
        --streams 1,2,4,8 --out /tmp/gloo

``--grad-path`` picks how gradients reach Gloo (``DataParallel.grad_path``): ``auto``
(default: ``mapped`` where the runtime keeps staging memory mapped, the Vulkan one, else
``host``), ``mapped`` (Gloo reduces the staging memory the device copied the gradients
into, and the update copies the sums from there: readback and upload are zero) or
``host`` (the sums go through host arrays: one copy out of the staging memory and one
upload per gradient, the path wgpu always takes).

Prints a table (rank 0) and writes ``data_parallel.json`` and ``data_parallel.md`` into
``--out`` (default bench/results/h200x2/). ``--size tiny`` (or ``small``) is a 2-layer model
that runs on a software driver in seconds; ``--size vocab`` is the same with SmolLM2's
vocabulary, so that its two embedding matrices have gradients of 12 MiB each (over the
8 MiB under which the Vulkan runtime defers an ordinary input upload): what the copies
cost shows on a software driver too.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import meganeura as mg  # noqa: E402
from meganeura import distributed as dist  # noqa: E402
from meganeura.models import llama  # noqa: E402
from meganeura.runtime.backends import get_runtime_device  # noqa: E402

def _tiny_wide_vocab():
    return dataclasses.replace(llama.LlamaConfig.tiny(), vocab_size=llama.LlamaConfig.smollm2_135m().vocab_size,
                               hidden_size=64, intermediate_size=128)


SIZES = {   # config, tokens per sequence, sequences per micro-batch, bucket megabytes
    "real": (llama.LlamaConfig.smollm2_135m, 128, 8, dist.DEFAULT_BUCKET_MB),
    "small": (llama.LlamaConfig.tiny, 16, 2, 0.01),
    "tiny": (llama.LlamaConfig.tiny, 16, 2, 0.01),
    "vocab": (_tiny_wide_vocab, 16, 2, dist.DEFAULT_BUCKET_MB),
}
GRAD_PATHS = {"auto": None, "mapped": True, "host": False}
STAGES = ("compute", "readback", "allreduce", "upload", "update")


def log(ctx, *msg):
    if ctx.rank == 0:
        print(*msg, file=sys.stderr, flush=True)


def batches(cfg, batch, seq, seed):
    """Deterministic token ids and labels, another stream per rank."""
    rng = np.random.default_rng(seed)
    while True:
        yield {"input_ids": rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32),
               "labels": rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32)}


def time_updates(step, data, accumulate, warmup, updates, on_warm=None):
    """Seconds per update (accumulate micro-steps each) after ``warmup`` updates."""
    for _ in range(warmup * accumulate):
        step(next(data))
    if on_warm is not None:
        on_warm()
    samples = []
    for _ in range(updates):
        t = time.perf_counter()
        for _ in range(accumulate):
            loss = step(next(data))
        samples.append(time.perf_counter() - t)
    if not np.isfinite(loss):
        raise FloatingPointError(f"loss is {loss} after {warmup + updates} updates")
    return samples


def single_gpu(ctx, cfg, args, k):
    g, _, _, loss = llama.build_training(cfg, args.batch, args.seq)
    with mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-4), accumulate=k, backend=ctx.runtime) as s:
        return time_updates(s.step, batches(cfg, args.batch, args.seq, 0), k, args.warmup, args.updates)


def data_parallel(ctx, cfg, args, k, streams):
    g, _, _, loss = llama.build_training(cfg, args.batch, args.seq)
    with dist.compile(g, loss, mg.optim.AdamW(lr=1e-4), accumulate=k, bucket_mb=args.bucket_mb,
                      mapped=GRAD_PATHS[args.grad_path], streams=streams, transport=args.transport) as s:
        samples = time_updates(s.step, batches(cfg, args.batch, args.seq, 1 + ctx.rank), k, args.warmup,
                               args.updates, on_warm=s.reset_timings)
        per_update = {key: v / max(s.updates_timed, 1) for key, v in s.timing_totals.items()}
        alone = allreduce_alone(ctx, s, args.updates)
        n_buckets, grad_mb = len(s.buckets), sum(b.n for b in s.buckets) * 4 / 2 ** 20
        args.grad_path_taken, args.transport_taken = s.grad_path, s.transport
    return samples, per_update, alone, n_buckets, grad_mb


def allreduce_alone(ctx, s, repeats):
    """Median seconds to all-reduce the session's buckets (launched together, then waited)."""
    if ctx.world_size == 1:
        return 0.0
    import torch.distributed as tdist
    out = []
    for _ in range(repeats):
        dist.barrier(ctx)
        t = time.perf_counter()
        for k, b in enumerate(s.buckets):   # on the session's streams and transport, split as it splits them
            b.start_allreduce(tdist, s.shm, k)
        for b in s.buckets:
            for w in b.works:
                w.wait()
            b.works = []
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def gloo_only(ctx, args, counts):
    """All-reduce ``args.gloo_mb`` MiB of float32 in ``args.bucket_mb`` buckets with each
    stream count: whole buckets round-robin and split as the session splits them, through
    Gloo; and split, through the session's shared memory where the ranks share a host."""
    import torch
    import torch.distributed as tdist
    limit = max(1, int(args.bucket_mb * 2 ** 20) // 4)
    total = int(args.gloo_mb * 2 ** 20) // 4
    sizes = [min(limit, total - a) for a in range(0, total, limit)]
    bufs = [torch.ones(n) for n in sizes]
    configs = []
    for n in counts:
        groups = ctx.stream_groups(n)
        for mode in ("whole", "split"):
            plan = [[(0, m, i % n)] for i, m in enumerate(sizes)] if mode == "whole" else dist.split_pieces(sizes, n)
            views = [(bufs[i][a:z], groups[j]) for i, pieces in enumerate(plan) for a, z, j in pieces]
            configs.append((n, mode, views, []))
    shm = dist.open_shm_allreduce(ctx, tdist, sizes)    # None across hosts or without room
    if shm is not None:         # the session's shared-memory transport, split as the session splits
        arrays = [b.numpy() for b in bufs]
        for n in counts:
            groups = ctx.stream_groups(n)
            views = [(k, a, z, groups[j]) for k, pieces in enumerate(dist.split_pieces(sizes, n)) for a, z, j in pieces]
            configs.append((n, "shm", views, []))
    for _ in range(args.warmup + args.updates):     # interleaved: the settings share any drift in load
        for n, mode, views, samples in configs:
            dist.barrier(ctx)
            t = time.perf_counter()
            if mode == "shm":
                works = [shm.start(k, arrays[k], a, z, g) for k, a, z, g in views]
            else:
                works = [tdist.all_reduce(v, group=g, async_op=True) for v, g in views]
            for w in works:
                w.wait()
            samples.append(time.perf_counter() - t)
    if shm is not None:
        shm.close()
    rows = []
    for n, mode, views, samples in configs:
        med = statistics.median(samples[args.warmup:])
        rows.append(dict(streams=n, mode=mode, pieces=len(views), seconds=samples[args.warmup:],
                         median_s=med, gib_per_s=total * 4 / 2 ** 30 / med))
    if ctx.rank == 0:
        head = f"| streams | buckets | all-reduces | ms | GiB/s | vs {counts[0]} stream(s) |"
        base = {r["mode"]: r["median_s"] for r in rows if r["streams"] == counts[0]}
        lines = [f"All-reduce (Gloo; shm: shared memory) of {args.gloo_mb:g} MiB float32 in {len(sizes)} buckets of at most "
                 f"{args.bucket_mb:g} MiB, {ctx.world_size} ranks, median of {args.updates} "
                 f"(GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME', '')!r})", "", head,
                 "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['streams']} | {r['mode']} | {r['pieces']} | {r['median_s'] * 1e3:.1f} | "
                         f"{r['gib_per_s']:.2f} | {base[r['mode']] / r['median_s']:.2f}x |")
        text = "\n".join(lines)
        print(text)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gloo_streams.json"), "w") as f:
            json.dump(dict(gloo_mb=args.gloo_mb, bucket_mb=args.bucket_mb, world_size=ctx.world_size,
                           min_piece_bytes=dist.transports.MIN_PIECE_BYTES, rows=rows,
                           gloo_socket_ifname=os.environ.get("GLOO_SOCKET_IFNAME"),
                           host=dict(platform=platform.platform(), cpus=os.cpu_count(),
                                     torch=torch.__version__)), f, indent=1)
        with open(os.path.join(args.out, "gloo_streams.md"), "w") as f:
            f.write(text + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="real")
    ap.add_argument("--backend", choices=("gpu", "vulkan", "wgpu"), default="gpu",
                    help="GPU runtime (gpu: the direct Vulkan backend where it runs, else wgpu)")
    ap.add_argument("--accumulate", default="1,4,16", help="comma-separated accumulation counts")
    ap.add_argument("--batch", type=int, help="sequences per micro-batch per GPU (real: 8, small: 2)")
    ap.add_argument("--seq", type=int, help="tokens per sequence (real: 128, small: 16)")
    ap.add_argument("--bucket-mb", type=float, help="gradient megabytes per all-reduce (real: 25)")
    ap.add_argument("--streams", help="comma-separated counts of concurrent all-reduce streams (default: "
                    f"${dist.STREAMS_ENV}, else {dist.DEFAULT_STREAMS})")
    ap.add_argument("--gloo-only", action="store_true", help="time the all-reduce alone: --gloo-mb MiB in --bucket-mb buckets through Gloo, and "
                         "through shared memory where the ranks share a host")
    ap.add_argument("--gloo-mb", type=float, default=513.0, help="--gloo-only: MiB all-reduced (SmolLM2: 513)")
    ap.add_argument("--transport", choices=dist.TRANSPORTS, default=None,
                    help="how the buckets are all-reduced: shared memory (ranks on one host), Gloo, or auto "
                         f"(default: ${dist.TRANSPORT_ENV}, else auto: shared memory where it can)")
    ap.add_argument("--grad-path", choices=sorted(GRAD_PATHS), default="auto",
                    help="how gradients reach Gloo: mapped staging memory, or host copies (auto: mapped on Vulkan)")
    ap.add_argument("--staged", action="store_true",
                    help="Vulkan: device memory apart from host memory, as on a discrete GPU, also on a "
                         "software or integrated one (uploads and readbacks through staging copies)")
    ap.add_argument("--warmup", type=int, default=2, help="updates before timing")
    ap.add_argument("--updates", type=int, default=5, help="timed updates per setting")
    ap.add_argument("--no-single", action="store_true", help="skip the one-GPU baseline")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "h200x2"))
    ap.add_argument("--timeout", type=float, default=3600.0, help="collective timeout, seconds")
    args = ap.parse_args(argv)
    make_cfg, seq, batch, bucket = SIZES[args.size]
    args.seq, args.batch = args.seq or seq, args.batch or batch
    args.bucket_mb = args.bucket_mb or bucket
    accs = [int(a) for a in args.accumulate.split(",")]
    counts = [dist.check_streams(int(a)) for a in args.streams.split(",")] if args.streams else \
        [dist._streams_setting()]
    args.stream_counts = counts
    if args.gloo_only:
        import torch.distributed as tdist
        tdist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
        ctx = dist.Context(tdist.get_rank(), tdist.get_world_size(), 0, "", args.timeout, None, 1)
        gloo_only(ctx, args, counts)
        tdist.destroy_process_group()
        return
    ctx = dist.init(timeout_s=args.timeout, backend=args.backend, streams=max(counts))
    if args.staged and ctx.runtime == "vulkan":
        from meganeura.runtime.vulkan import backend as vkb, device as vkdev
        staged = vkdev.VulkanDevice(str(vkdev.get_vulkan_device().index), direct_host_access=False)
        atexit.register(staged.close)
        vkb._runtime = vkb.VulkanRuntime(staged)
    cfg = make_cfg()
    dev = get_runtime_device(ctx.runtime)
    mine = f"{ctx.adapter} ({dev.adapter_info['backend']}{', staged memory' if args.staged else ''})"
    devices = [mine] * ctx.world_size
    if ctx.world_size > 1:
        import torch.distributed as tdist
        tdist.all_gather_object(devices, mine)
    log(ctx, f"data-parallel SmolLM2 ({args.size}) on the {ctx.runtime} runtime: {ctx.world_size} rank(s) on "
             f"{devices}; micro-batch {args.batch} x {args.seq} tokens per GPU, accumulate {accs}")
    rows = []
    for k in accs:
        single = None               # one baseline per accumulation
        for m, streams in enumerate(counts):
            row = {"accumulate": k, "streams": streams}
            if not args.no_single:
                if m == 0:
                    if ctx.rank == 0:
                        log(ctx, f"accumulate {k}: one GPU ...")
                        single = single_gpu(ctx, cfg, args, k)
                    dist.barrier(ctx)
                if ctx.rank == 0:
                    row["single_s"] = single
            log(ctx, f"accumulate {k}: {ctx.world_size} GPU(s), {streams} all-reduce stream(s) ...")
            samples, per_update, alone, n_buckets, grad_mb = data_parallel(ctx, cfg, args, k, streams)
            every = [None] * ctx.world_size
            if ctx.world_size > 1:
                import torch.distributed as tdist
                tdist.all_gather_object(every, {"samples": samples, "stages": per_update})
            else:
                every = [{"samples": samples, "stages": per_update}]
            tokens = k * args.batch * args.seq
            dp_s = statistics.median(samples)
            row.update(parallel_s=samples, ranks=every, allreduce_alone_s=alone, buckets=n_buckets,
                       grad_mb=grad_mb, tokens_per_update_per_gpu=tokens,
                       parallel_tokens_per_s=ctx.world_size * tokens / dp_s)
            if "single_s" in row:
                row["single_tokens_per_s"] = tokens / statistics.median(row["single_s"])
                row["speedup"] = row["parallel_tokens_per_s"] / row["single_tokens_per_s"]
            rows.append(row)
    if ctx.rank == 0:
        report(ctx, args, devices, rows)
    dist.shutdown()


PATH_WORDS = {"mapped": "in the mapped staging memory (grad path: mapped)",
              "host": "in host arrays, copied out and uploaded (grad path: host)"}


def report(ctx, args, devices, rows):
    n = ctx.world_size
    head = (f"| accumulate | streams | 1 GPU tokens/s | {n} GPUs tokens/s | speedup | ms per update: "
            + " | ".join(STAGES) + " | total | all-reduce alone ms |")
    lines = [f"SmolLM2 ({args.size}) data-parallel training on {n} GPUs ({', '.join(devices)}), {ctx.runtime} runtime; micro-batch "
             f"{args.batch} x {args.seq} tokens per GPU, AdamW, strict f32, median of {args.updates} updates; "
             f"stage times: mean over ranks of host ms per update", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        st = {key: statistics.mean(e["stages"][key] for e in r["ranks"]) * 1e3 for key in STAGES + ("total",)}
        single = f"{r['single_tokens_per_s']:.0f}" if "single_tokens_per_s" in r else "-"
        speed = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        lines.append(f"| {r['accumulate']} | {r['streams']} | {single} | {r['parallel_tokens_per_s']:.0f} | {speed} | "
                     + " | ".join(f"{st[key]:.1f}" for key in STAGES)
                     + f" | {st['total']:.1f} | {r['allreduce_alone_s'] * 1e3:.1f} |")
    lines.append("")
    lines.append(f"gradients: {rows[0]['grad_mb']:.1f} MiB in {rows[0]['buckets']} bucket(s) of at most "
                 f"{args.bucket_mb:g} MiB, all-reduced {PATH_WORDS[args.grad_path_taken]}, through "
                 f"{'shared memory' if args.transport_taken == 'shm' else 'Gloo'}; streams: "
                 f"concurrent all-reduces, each on a Gloo process group of its own, buckets split over them")
    text = "\n".join(lines)
    print(text)
    import torch
    out = dict(workload="smollm2", size=args.size, runtime=ctx.runtime, world_size=n, devices=devices,
               batch=args.batch, seq=args.seq, grad_path=args.grad_path_taken, transport=args.transport_taken,
               streams=args.stream_counts,
               bucket_mb=args.bucket_mb, warmup=args.warmup, updates=args.updates, rows=rows,
               host=dict(python=sys.version.split()[0], platform=platform.platform(), numpy=np.__version__,
                         torch=torch.__version__, backend="gloo"))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "data_parallel.json"), "w") as f:
        json.dump(out, f, indent=1, default=float)
    with open(os.path.join(args.out, "data_parallel.md"), "w") as f:
        f.write(text + "\n")
    print(f"wrote {os.path.join(args.out, 'data_parallel.json')} and data_parallel.md", file=sys.stderr)


if __name__ == "__main__":
    main()
