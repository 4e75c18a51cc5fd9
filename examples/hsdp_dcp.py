"""HSDP with 1-bit Adam across the replicas, checkpointed with torch.distributed.checkpoint and
resumed on another mesh.

FSDP2 shards the model inside each replica (``mesh["shard"]``, the fast intra-node link); the
optimizer's exchange crosses the replicas (``backend=mesh["replicate"]``, the slow link): full
precision in warmup, 1-bit after ``freeze_step``. Run it (CPU, Gloo; ``--device cuda`` on GPUs):

    torchrun --nproc-per-node 4 examples/hsdp_dcp.py --replicas 2 --steps 20 --save /tmp/ckpt
    torchrun --nproc-per-node 2 examples/hsdp_dcp.py --replicas 1 --steps 10 --load /tmp/ckpt --reshard

The second run resumes the first's checkpoint on 2 ranks (one replica sharded 2 ways): the
moments are resharded by DCP, the error feedback starts again from zero (a warning says so).
Without ``--reshard`` a checkpoint of another mesh is refused, saying so.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import compressed_opt
from compressed_opt.dcp import OptimizerState


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2, help="replicas (the rest of the ranks shard each one)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--freeze-step", type=int, default=5)
    ap.add_argument("--save", help="a DCP checkpoint folder to write after the steps")
    ap.add_argument("--load", help="a DCP checkpoint folder to resume from before the steps")
    ap.add_argument("--reshard", action="store_true", help="the checkpoint was saved on another mesh")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.replicas:
        raise SystemExit(f"--replicas {args.replicas} does not divide the {world} ranks")
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else None
    if device is not None:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(args.device, (args.replicas, world // args.replicas),
                            mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(0)  # every rank starts from the same model
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    if device is not None:
        model.to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = compressed_opt.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=args.freeze_step,
                                    backend=mesh["replicate"])

    if args.load:
        state = {"model": model.state_dict(), "optim": OptimizerState(opt, reshard=args.reshard)}
        dcp.load(state, checkpoint_id=args.load)
        model.load_state_dict(state["model"])
        if rank == 0:
            print(f"resumed at step {opt.global_step} ({'compressing' if opt.compressing else 'warmup'})")

    data = torch.Generator().manual_seed(1234 + rank)
    for _ in range(args.steps):
        x = torch.randn(32, 64, generator=data)
        y = torch.randint(0, 10, (32,), generator=data)
        if device is not None:
            x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    if rank == 0:
        stats = opt.comm_stats()
        print(f"step {opt.global_step}: loss {loss.item():.4f}; {stats}")

    if args.save:
        dcp.save({"model": model.state_dict(), "optim": OptimizerState(opt)}, checkpoint_id=args.save)
        if rank == 0:
            print(f"saved {args.save}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
