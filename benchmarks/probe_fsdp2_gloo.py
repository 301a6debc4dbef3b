"""Does FSDP2 (torch.distributed.fsdp.fully_shard) run on CPU over gloo? A standalone probe, 2 processes:

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 benchmarks/probe_fsdp2_gloo.py [--accelerate]

Checks, each printed as `PROBE <name>: ok|FAIL <one line>` by rank 0:
  raw_step      fully_shard per layer + root on a cpu mesh: forward/backward/AdamW step matches a replicated model
                with all-reduced gradients (to tolerance)
  dtensor_ema   EMA mixing and an in-place swap on the sharded (DTensor) parameters, elementwise on local shards
  state_dict    get_model_state_dict(full_state_dict=True) equals the replicated model; set_model_state_dict round trip
  dcp           torch.distributed.checkpoint save/load of the sharded state dict
  no_sync       set_requires_gradient_sync(False) accumulation, then a synced backward, matches one big backward
  accelerate    (--accelerate) Accelerator() with ACCELERATE_USE_FSDP=true/FSDP_VERSION=2 env on CPU: which
                distributed type accelerate picks and whether prepare() shards the model
"""
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist


def report(name, fn):
    try:
        msg = fn() or ""
        line = f"PROBE {name}: ok {msg}".rstrip()
    except Exception as e:  # noqa: BLE001 - the probe reports every failure as one line
        line = f"PROBE {name}: FAIL {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if os.environ.get("PROBE_TRACE"):
            traceback.print_exc()
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, flush=True)


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def shard(m, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def raw_checks():
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(100 + rank)
    x, y = torch.randn(6, 8), torch.randn(6, 4)

    def raw_step():
        ref, sh = model(), shard(model(), mesh)
        o_ref, o_sh = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, sh))
        for _ in range(3):
            torch.nn.functional.mse_loss(ref(x), y).backward()
            for p in ref.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            torch.nn.functional.mse_loss(sh(x), y).backward()
            o_ref.step(); o_sh.step(); o_ref.zero_grad(); o_sh.zero_grad()
        diff = max((p.full_tensor() - q).abs().max().item() for p, q in zip(sh.parameters(), ref.parameters()))
        assert diff < 1e-5, f"max |sharded - replicated| = {diff}"
        kind = type(next(sh.parameters())).__name__
        return f"(params are {kind}, max diff {diff:.1e})"

    def dtensor_ema():
        sh = shard(model(), mesh)
        ema = {n: p.detach().clone() for n, p in sh.named_parameters()}
        with torch.no_grad():
            for p in sh.parameters():
                p.add_(1.0)
            for n, p in sh.named_parameters():
                ema[n].mul_(0.5).add_(p.detach(), alpha=0.5)  # the EMAReference.step arithmetic
            full = {n: t.full_tensor() for n, t in ema.items()}
            base = dict(model().named_parameters())
            for n, t in full.items():
                assert torch.allclose(t, base[n] + 0.5), n
            # the EMAReference.swapped exchange, in place on DTensors
            for n, p in sh.named_parameters():
                tmp = p.detach().clone(); p.copy_(ema[n]); ema[n].copy_(tmp)
            out = sh(x)  # forward with the swapped-in values
            for n, p in sh.named_parameters():
                tmp = p.detach().clone(); p.copy_(ema[n]); ema[n].copy_(tmp)
            for n, p in sh.named_parameters():
                assert torch.equal(p.full_tensor(), base[n] + 1.0), n
        return f"(local shard of {n}: {tuple(p.to_local().shape)} of {tuple(p.shape)}; swapped forward {tuple(out.shape)})"

    def state_dict():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

        sh = shard(model(), mesh)
        full = get_model_state_dict(sh, options=StateDictOptions(full_state_dict=True))
        ref = model().state_dict()
        assert full.keys() == ref.keys() and all(torch.equal(full[k], ref[k]) for k in ref)
        other = shard(model(seed=1), mesh)
        set_model_state_dict(other, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
        again = get_model_state_dict(other, options=StateDictOptions(full_state_dict=True))
        assert all(torch.equal(again[k], ref[k]) for k in ref)
        return "(full state dict gathered on every rank, round trip exact)"

    def dcp():
        import torch.distributed.checkpoint as dcp_mod

        sh = shard(model(), mesh)
        path = [tempfile.mkdtemp(prefix="probe_dcp_") if rank == 0 else None]
        dist.broadcast_object_list(path)
        dcp_mod.save({"model": sh.state_dict()}, checkpoint_id=path[0])
        other = shard(model(seed=1), mesh)
        sd = {"model": other.state_dict()}
        dcp_mod.load(sd, checkpoint_id=path[0])
        other.load_state_dict(sd["model"])
        for p, q in zip(sh.parameters(), other.parameters()):
            assert torch.equal(p.full_tensor(), q.full_tensor())
        return f"(files: {sorted(os.listdir(path[0]))})"

    def no_sync():
        a, b = shard(model(), mesh), shard(model(), mesh)
        xs, ys = x.chunk(2), y.chunk(2)
        a.set_requires_gradient_sync(False)
        torch.nn.functional.mse_loss(a(xs[0]), ys[0]).div(2).backward()
        a.set_requires_gradient_sync(True)
        torch.nn.functional.mse_loss(a(xs[1]), ys[1]).div(2).backward()
        for xi, yi in zip(xs, ys):
            torch.nn.functional.mse_loss(b(xi), yi).div(2).backward()
        diff = max((p.grad.full_tensor() - q.grad.full_tensor()).abs().max().item()
                   for p, q in zip(a.parameters(), b.parameters()))
        assert diff < 1e-6, diff
        return f"(max grad diff {diff:.1e})"

    for name, fn in (("raw_step", raw_step), ("dtensor_ema", dtensor_ema), ("state_dict", state_dict), ("dcp", dcp),
                     ("no_sync", no_sync)):
        report(name, fn)


def accelerate_check():
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    def acc():
        a = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        m = a.prepare(model())
        from torch.distributed.fsdp import FSDPModule

        sharded = isinstance(m, FSDPModule)
        return (f"(distributed_type={a.distributed_type.value}, is_fsdp2={a.is_fsdp2}, model sharded={sharded}, "
                f"wrapper={type(m).__name__})")

    report("accelerate", acc)


if __name__ == "__main__":
    if "--accelerate" in sys.argv:
        accelerate_check()  # accelerate forms the gloo group itself
    else:
        import datetime
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a failed check must not hang
        raw_checks()
        dist.destroy_process_group()
