"""Two ranks of one NCCL group on one GPU: what NCCL says (why hosfl_dist refuses a server group that shares a GPU and
reduces the client workers' scalars through gloo when they share one).

    torchrun --nproc-per-node=2 results/gpu/nccl_shared_gpu.py
"""

import os

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
torch.cuda.set_device(0)
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
x = torch.ones(4, device="cuda:0")
try:
    dist.all_reduce(x)
    torch.cuda.synchronize()
    print(f"rank {rank}: all_reduce on a shared GPU worked: {x.tolist()}", flush=True)
except Exception as exc:  # noqa: BLE001 - the point is to print what NCCL says
    first = str(exc).splitlines()[0] if str(exc) else ""
    print(f"rank {rank}: all_reduce on a shared GPU failed: {type(exc).__name__}: {first}", flush=True)
finally:
    dist.destroy_process_group()
