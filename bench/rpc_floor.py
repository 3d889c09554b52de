"""The transport floor of one round: a loopback RPC round trip and an all_reduce of the K×P scalar matrix.

Run under torchrun with the runtime's layout (rank 0 the server, ranks 1.. client workers), e.g.

    torchrun --nproc-per-node=3 -m bench.rpc_floor --up-bytes 401408 --down-bytes 401408 --K 4 --P 5 --out floor.json

Each worker times ``--repeat`` RPC round trips to rank 0 that carry ``--up-bytes`` of float32 up and get
``--down-bytes`` back (what a submit moves: z up, λ down), and ``--repeat`` all_reduces of a (K, P) float32 matrix
over the workers' gloo group (what the scalar aggregation moves), and ``--repeat`` round trips that carry nothing (a
``sync``'s or a report's size: ``small_round_trip_s``). ``--transports`` / ``--channels`` pick TensorPipe's (the
``dist`` benchmark passes the product's, ``hosfl_dist.runtime.process.groups.RPC_TRANSPORTS`` / ``RPC_CHANNELS``;
TensorPipe's defaults busy-poll). Medians per worker, in seconds, are written as JSON by the first worker. Only
torch is imported: the ``dist`` benchmark (``bench/dist_bench.py``) runs this beside the real runs so that the
round's transport time can be read against what the same machine needs at least, measured at the same time (its
``torchrun_w<W>_transport_ms`` figures' floor).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc


def echo(payload: torch.Tensor | None, down: int) -> torch.Tensor | None:
    """Rank 0's answer: a tensor of ``down`` float32 values (the λ of a submit), nothing for 0."""
    return torch.zeros(down, dtype=torch.float32) if down else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--up-bytes", type=int, default=0, help="bytes carried to rank 0 per round trip")
    p.add_argument("--down-bytes", type=int, default=0, help="bytes carried back per round trip")
    p.add_argument("--K", type=int, default=4, help="rows of the aggregated scalar matrix (clients per round)")
    p.add_argument("--P", type=int, default=5, help="columns (perturbations)")
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--transports", nargs="*", help="TensorPipe transports (default: TensorPipe's)")
    p.add_argument("--channels", nargs="*", help="TensorPipe channels (default: TensorPipe's)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    workers = dist.new_group(list(range(1, world)), timeout=timeout)
    chosen = {"_transports": args.transports, "_channels": args.channels}
    opts = rpc.TensorPipeRpcBackendOptions(
        rpc_timeout=120, num_worker_threads=16, **{k: v for k, v in chosen.items() if v}
    )
    rpc.init_rpc("server" if rank == 0 else f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    result: dict = {}
    if rank > 0:
        up = torch.zeros(args.up_bytes // 4, dtype=torch.float32)
        down = args.down_bytes // 4
        rtt, red = [], []
        for i in range(args.warmup + args.repeat):
            start = time.perf_counter()
            rpc.rpc_sync("server", echo, args=(up, down))
            if i >= args.warmup:
                rtt.append(time.perf_counter() - start)
        small = []
        for i in range(args.warmup + args.repeat):
            start = time.perf_counter()
            rpc.rpc_sync("server", echo, args=(None, 0))
            if i >= args.warmup:
                small.append(time.perf_counter() - start)
        rows = torch.zeros(args.K, args.P, dtype=torch.float32)
        for i in range(args.warmup + args.repeat):
            dist.all_reduce(rows, group=workers)  # lockstep: every worker runs the same count
            start = time.perf_counter()
            dist.all_reduce(rows, group=workers)
            if i >= args.warmup:
                red.append(time.perf_counter() - start)
        result = {
            "rpc_round_trip_s": statistics.median(rtt),
            "all_reduce_s": statistics.median(red),
            "small_round_trip_s": statistics.median(small),
        }
        everyone: list = [None] * (world - 1)
        dist.all_gather_object(everyone, result, group=workers)
        if rank == 1 and args.out:
            floor = {
                "rpc_round_trip_s": statistics.median(r["rpc_round_trip_s"] for r in everyone),
                "all_reduce_s": statistics.median(r["all_reduce_s"] for r in everyone),
                "small_round_trip_s": statistics.median(r["small_round_trip_s"] for r in everyone),
                "transports": args.transports,
                "channels": args.channels,
                "per_worker": everyone,
                "up_bytes": args.up_bytes,
                "down_bytes": args.down_bytes,
                "K": args.K,
                "P": args.P,
                "repeat": args.repeat,
            }
            with open(args.out, "w") as f:
                json.dump(floor, f, indent=2)
    rpc.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
