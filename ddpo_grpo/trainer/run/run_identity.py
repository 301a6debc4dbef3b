"""One run across machines: its name, folder, wandb id and resume checkpoint, agreed by every process.

Each machine's clock would name its own run folder (`tiny_..._230053` and `tiny_..._230054`), and each would then save
into its own folder and wait on the other at the first checkpoint. So, once the process group exists and before
anything is written, global rank 0 decides the run name and the wandb id and broadcasts them; every machine joins the
name with its own `config.logdir` (the same path on a shared filesystem, or a local disk per machine).

Whether the machines share that folder is detected, not configured: each machine's local main process drops a token
file named by a nonce from rank 0 into its run folder and reports which machines' tokens it sees. All see all: a
shared filesystem, and the global main process writes each checkpoint once. Each sees only its own: no shared
filesystem, accelerate's `save_on_each_node` (each machine's local main process writes a complete checkpoint for its
ranks; every process writes its own RNG state on its machine).
Anything else (some machines share the folder, others do not) is one ConfigError line.

A resume on several machines loads the newest checkpoint that every machine holds complete: a machine that died
mid-save has only the previous one, and the others keep that one until every machine has renamed the new one
(checkpointing.save_checkpoint prunes after a barrier).
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

from ddpo_grpo.errors import ConfigError

from .checkpointing import (META, check_compatible, check_files, complete_checkpoints, run_folder_of,
                            wandb_run_id)


@dataclass
class RunPlace:
    dir: str  # this machine's run folder
    ckpt: str  # this machine's checkpoint to resume from ("" = a fresh run)
    shared: bool  # every process sees the same run folder (one copy of each checkpoint), else one copy per machine
    wandb_id: str  # decided by global rank 0 ("" on the others before the broadcast)


def broadcast(obj, acc):
    """obj as global rank 0 holds it, on every process."""
    if acc.num_processes == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj, acc) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every process."""
    if acc.num_processes == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * acc.num_processes
    dist.all_gather_object(out, obj)
    return out


def agree_run(acc, config, ckpt: str, default_name: str, family: str) -> RunPlace:
    """The run's folder on this machine, whether all machines share it, and the checkpoint to resume from.
    Every process calls it once the process group exists (acc: accelerate's PartialState, or the Accelerator) and
    before anything is written. ckpt: this machine's check_resume result ("" for a fresh run); default_name: the
    `<config>_<timestamp>` name (rank 0's is used)."""
    from .scale import engine

    if config.run_name:
        name = config.run_name
    else:
        name = os.path.basename(run_folder_of(ckpt)) if ckpt and run_folder_of(ckpt) else default_name
    name, nonce = broadcast((name, uuid.uuid4().hex[:12]), acc)
    local = run_folder_of(ckpt) if ckpt and not config.run_name else None
    run_dir = local or os.path.join(config.logdir, name)
    os.makedirs(run_dir, exist_ok=True)
    shared = _detect_shared(acc, run_dir, nonce)
    # train.hacking_guard="stop" saves a checkpoint when its alarm fires, whatever save_freq says (scripts/train.py)
    saves = config.save_freq or config.train.get("hacking_guard", "off") == "stop"
    if not shared and engine() == "fsdp2" and (saves or ckpt):
        raise ConfigError(
            f"the run folder {run_dir} is not shared by all machines, and FSDP2's sharded checkpoints need one "
            "filesystem (each process writes its shard, rank 0 the index): give every machine a --config.logdir on "
            "a shared filesystem, or --config.save_freq=0 (and train.hacking_guard other than 'stop')")
    if ckpt:
        ckpt = _common_checkpoint(acc, config, ckpt, family)
    wandb_id = wandb_run_id(run_dir) if acc.is_main_process else ""
    return RunPlace(run_dir, ckpt, shared, broadcast(wandb_id, acc))


def _detect_shared(acc, run_dir: str, nonce: str) -> bool:
    """True when every machine sees the others' tokens in its run folder (one filesystem), False when each sees only
    its own (save on each node); ConfigError otherwise. One token per machine, by its local main process; the
    processes of a machine run the same command, so they share its view. Tokens are looked up by name, never
    listed: a name no one looked up before is asked of the server (an NFS client may serve a listing from cache)."""
    if acc.num_processes == 1:
        return True
    token = os.path.join(run_dir, f".machine-{nonce}-")
    if acc.is_local_main_process:
        with open(token + str(acc.process_index), "w") as f:
            os.fsync(f.fileno())
    # a collective: once it returns, every machine's token is written
    mains = [r for r, is_main in enumerate(gather(acc.is_local_main_process, acc)) if is_main]
    seen = tuple(r for r in mains if os.path.exists(token + str(r))) if acc.is_local_main_process else None
    every = gather(seen, acc)  # once it returns, every machine has looked: the tokens may go
    if acc.is_local_main_process:
        os.remove(token + str(acc.process_index))
    return filesystem_layout({r: every[r] for r in mains})


def filesystem_layout(seen: dict) -> bool:
    """seen: {local main rank: the local main ranks whose token it sees}, one entry per machine. True: one shared
    filesystem; False: one per machine (each sees only its own); else ConfigError."""
    if all(set(s) == set(seen) for s in seen.values()):
        return True
    if all(tuple(s) == (r,) for r, s in seen.items()):
        return False
    raise ConfigError(
        f"the run folder is shared by some machines but not all (machine main ranks and the machines' run folders "
        f"each sees: {seen}): give every machine a --config.logdir on one shared filesystem, or each machine a "
        "folder of its own")


def _epoch_of(path: str) -> int:
    return int(os.path.basename(path).rsplit("_", 1)[1])


def _common_checkpoint(acc, config, ckpt: str, family: str) -> str:
    """The newest checkpoint every process holds complete (each in its own run folder), as this process's path."""
    if os.path.abspath(ckpt) == os.path.abspath(config.resume_from.rstrip("/")):
        mine = [ckpt]  # resume_from named a checkpoint folder: that epoch or nothing
    else:
        mine = complete_checkpoints(os.path.dirname(ckpt))
    epochs = {_epoch_of(p): p for p in mine}
    every = gather(sorted(epochs), acc)
    common = set(every[0]).intersection(*every[1:])
    if not common:
        raise ConfigError(
            f"resume_from={config.resume_from!r}: no checkpoint epoch is complete on every machine (complete "
            f"{META} checkpoints per process: {every}); resume from an older run folder or start afresh")
    chosen = epochs[max(common)]
    if chosen != ckpt:  # an older one than check_resume looked at: check it as thoroughly
        check_files(chosen)
        check_compatible(chosen, config, family)
    return chosen
