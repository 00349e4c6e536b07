"""Data-parallel training: one process per GPU, gradients averaged by torch.distributed.

Launch one process per GPU with PyTorch's launcher; each process builds the same graph and
trains on its own share of every batch::

    torchrun --nproc_per_node 2 train.py          # one machine, two GPUs
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST --nproc_per_node 2 train.py

    import meganeura as mg
    from meganeura import distributed as dist
    ctx = dist.init()                              # joins the group; picks this process's GPU
    s = dist.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-3), accumulate=4)
    for xb, yb in batches:
        s.step(dist.shard({"x": xb, "labels": yb}))
    s.save("model.safetensors")                    # rank 0 writes it; every rank can load it

A step runs forward and backward on the device, copies the gradients to host-visible
staging memory in buckets as soon as the kernels that write them have run (the step is
submitted in segments that end where a bucket is final), all-reduces each bucket with an
asynchronous Gloo collective while later buckets are still being computed or copied (split
over several concurrent streams, each a Gloo process group of its own: ``init(streams=)``), and
runs the optimizer update (the session's "update" phase) on the sums scaled to the mean.
On the Vulkan runtime Gloo reduces the mapped staging memory itself and the update copies
the sums from it in its own command buffer; on wgpu the buckets go through host arrays
(``DataParallel.grad_path``). Gloo runs on CPU tensors, between processes and machines;
see docs/distributed.md for why it was chosen. Ranks on one host can sum the buckets in shared
memory instead (``compile(transport="auto")``: faster where cores are few).

torch is an optional extra (``pip install 'meganeura[distributed]'``); this module imports
it only when used, and ``import meganeura`` never does.

The package's modules: ``ranks`` (the process group, each rank's GPU, sharding),
``transports`` (Gloo or shared memory, pieces over the streams), ``buckets`` (gradients in
staging memory) and ``data_parallel`` (the session).
"""
from __future__ import annotations

from . import ranks
from .buckets import DEFAULT_BUCKET_MB
from .data_parallel import TIMING_KEYS, DataParallel, compile, plan_signature
from .ranks import (DEFAULT_STREAMS, DEFAULT_TIMEOUT_S, MAX_STREAMS, STREAMS_ENV, Context, DistributedError,
                    _by_local_rank, _resolve_for_rank, _streams_setting, _torch_dist, barrier, check_streams, init,
                    select_adapter, shard, shard_indices, shutdown)
from .transports import (DEFAULT_TRANSPORT, TRANSPORT_ENV, TRANSPORTS, _shm_room, _transport_setting,
                         open_shm_allreduce, split_pieces)

# (settings read where they are used, such as ``transports.MIN_PIECE_BYTES`` and ``SHM_DIR``, are set
# on their own module)
__all__ = ["barrier", "check_streams", "compile", "Context", "DataParallel", "DEFAULT_BUCKET_MB", "DEFAULT_STREAMS",
           "DEFAULT_TIMEOUT_S", "DEFAULT_TRANSPORT", "DistributedError", "init", "MAX_STREAMS", "open_shm_allreduce",
           "plan_signature", "select_adapter", "shard", "shard_indices", "shutdown", "split_pieces", "STREAMS_ENV",
           "TIMING_KEYS", "TRANSPORT_ENV", "TRANSPORTS", "_by_local_rank", "_resolve_for_rank", "_shm_room",
           "_streams_setting", "_torch_dist", "_transport_setting"]


def __getattr__(name):
    # the process's context lives in ``ranks`` (``init`` sets it): read there, never copied
    if name == "_context":
        return ranks._context
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
