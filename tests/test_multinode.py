"""Two "machines" on loopback: config/accelerate/ddp_multinode.yaml launched twice on this CPU machine (gloo,
ACCELERATE_USE_CPU=1, --num_machines 2 --machine_rank 0|1 --main_process_ip 127.0.0.1), one process each, the
second launch 1 s after the first, as a user would start two machines.

* shared logdir (one filesystem): one run folder, named by machine 0's clock; the same rewards, advantages and weights
  as a 2-process run on one machine; machine 1's processes SIGKILLed after the first checkpoint, machine 0 ends with one
  line, and a resume of both ends bit-identical to the uninterrupted single-machine run.
* a logdir per machine (no shared filesystem): one run folder per machine, same name; each holds complete checkpoints
  for its own ranks; the same kill and resume, each machine from its own copy.
* a peer that dies before the process group forms: the other ends within collective_timeout_s with one line.
"""
import glob
import json
import os
import subprocess
import time

import pytest
import torch
from helpers import cpu_env, launch_cmd
from machines import EPOCHS, ROOT, SMALL, TIMEOUT_S, LateKill, free_port, machine_cmd, two_machines
from safetensors.torch import load_file

def dumps(run_dirs, epoch):
    """Every rank's debug record of `epoch`, in rank order, from whichever run folder holds it."""
    files = {os.path.basename(f): f for d in run_dirs
             for f in glob.glob(os.path.join(d, "debug", f"epoch_{epoch:04d}_rank_*.json"))}
    return [json.load(open(files[k])) for k in sorted(files)]


def run_folders(logdir):
    return sorted(p for p in glob.glob(os.path.join(str(logdir), "*")) if os.path.isdir(p))


def single_machine(tmp, nproc, fsdp=False):
    """The reference: one machine, nproc processes, uninterrupted."""
    launch = machine_cmd(0, free_port(), fsdp=True)[:-len(SMALL) - 1] if fsdp else [*launch_cmd(nproc, 29100)]
    if fsdp:  # the FSDP line as one machine of nproc processes
        launch[launch.index("--num_machines") + 1], launch[launch.index("--num_processes") + 1] = "1", str(nproc)
    script = "tests/fsdp_cpu_train.py" if fsdp else "scripts/train.py"
    cmd = [*launch, script, *SMALL, f"--config.logdir={tmp}", "--config.run_name=single"]
    p = subprocess.run(cmd, cwd=ROOT, env=cpu_env(PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return tmp / "single"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return single_machine(tmp_path_factory.mktemp("single"), 2)


def kill_and_resume(logdirs, per_machine=1, fsdp=False):
    """Two machines; machine 1 SIGKILLed once its copy of the first checkpoint is complete; then both resumed, each
    from its own run folder. Returns the run folders (machine 0's, machine 1's) and the resume's outputs."""
    def first_ckpt():  # machine 1's view of the run folder rank 0 named
        folders = run_folders(logdirs[1])
        return os.path.join(folders[0], "checkpoints", "checkpoint_00001", "run_meta.json") if folders else None

    try:
        outs, rcs = two_machines(logdirs, kill_when=first_ckpt, per_machine=per_machine, fsdp=fsdp)
    except LateKill:  # the test's race, not the trainer's: once more in fresh folders
        logdirs = [os.path.join(str(d), "again") for d in logdirs]
        outs, rcs = two_machines(logdirs, kill_when=first_ckpt, per_machine=per_machine, fsdp=fsdp)
    folders = [run_folders(d) for d in logdirs]
    assert all(len(f) == 1 for f in folders), folders  # one run folder (one per machine without a shared filesystem)
    run_dirs = [folders[0][0], folders[1][0]]
    assert os.path.basename(run_dirs[0]) == os.path.basename(run_dirs[1])  # rank 0's name on both
    assert rcs[0] != 0 and rcs[1] != 0, outs[0][-3000:]  # killed before the end: the resume has epochs left to run
    line = [ln for ln in outs[0].splitlines() if f"error: another process of this {2 * per_machine}-process job stopped" in ln]
    assert line and f"collective_timeout_s={TIMEOUT_S} s" in line[0], outs[0][-3000:]
    assert "Traceback" not in outs[0][:outs[0].index(line[0])]  # the trainer's one line (torchrun's summary follows)
    # (no bound on how long machine 0 took: two_machines' END_WAIT_S fails a hang, the line above names the setting)
    outs, rcs = two_machines(logdirs, extra=[[f"--config.resume_from={d}"] for d in run_dirs],
                                per_machine=per_machine, fsdp=fsdp)
    assert rcs == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    resumed = [ln for ln in outs[0].splitlines() if "resumed from" in ln]
    assert resumed and " at epoch " in resumed[0]
    at = int(resumed[0].rsplit(" ", 1)[1])
    assert 1 <= at < EPOCHS
    return run_dirs, at


def assert_same_as_single(run_dirs, single, nproc=2, rounding_from=None):
    """Every epoch's records and the final weights equal the single-machine run's, bit for bit. rounding_from: the
    epoch from which weights may differ by summation order only (a resume with more than 2 DDP processes: see
    test_two_processes_per_machine_logdir_per_machine)."""
    for epoch in range(EPOCHS):
        got, want = dumps(run_dirs, epoch), dumps([single], epoch)
        assert len(got) == len(want) == nproc
        for a, b in zip(got, want):
            for key in ("keys", "rewards", "advantages", "keys_all", "rewards_all", "advantages_all"):
                assert a[key] == b[key], (epoch, a["rank"], key)
            for key in ("weights_sum", "weights_abs_sum"):
                if rounding_from is not None and epoch >= rounding_from:
                    assert a[key] == pytest.approx(b[key], rel=1e-9), (epoch, a["rank"], key)
                else:
                    assert a[key] == b[key], (epoch, a["rank"], key)
    final = f"checkpoints/checkpoint_{EPOCHS:05d}/model.safetensors"
    if not os.path.exists(os.path.join(single, final)):  # FSDP2: sharded; the records' whole-model checksums count
        return
    want = load_file(os.path.join(single, final))
    for d in run_dirs:
        got = load_file(os.path.join(d, final))
        assert got.keys() == want.keys()
        if rounding_from is None:
            assert all(torch.equal(got[k], want[k]) for k in want)
        else:
            assert all(torch.allclose(got[k], want[k], rtol=0, atol=1e-6) for k in want)


def test_run_name_is_rank_0s_whatever_each_machine_s_clock_says(tmp_path):
    """A logdir per machine, machine 1's clock 5 h ahead: both run folders carry rank 0's name (<config>_<time>),
    the one machine 0's clock gives. Fails if the name is taken from each machine's own clock (the broadcast in
    trainer/run/run_identity.agree_run removed)."""
    logdirs = [tmp_path / "m0", tmp_path / "m1"]
    t0 = time.localtime()
    outs, rcs = two_machines(logdirs, extra=[["--config.num_epochs=1", "--config.save_freq=0"]] * 2)
    assert rcs == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    names = [os.path.basename(f) for d in logdirs for f in run_folders(d)]
    assert len(names) == 2 and names[0] == names[1], names
    hour = int(names[0].rsplit("_", 1)[1][:2])  # machine 0's clock: this process's zone, not machine 1's
    assert hour in (t0.tm_hour, (t0.tm_hour + 1) % 24), (names, t0.tm_hour)


def test_shared_logdir_one_run_exact_resume(tmp_path, single):
    logdir = tmp_path / "shared"
    run_dirs, _ = kill_and_resume([logdir, logdir])
    assert run_dirs[0] == run_dirs[1]
    ckpts = sorted(os.listdir(os.path.join(run_dirs[0], "checkpoints")))
    assert ckpts == [f"checkpoint_{EPOCHS:05d}"]  # the limit of 1 kept; no .tmp- left over
    names = set(os.listdir(os.path.join(run_dirs[0], "checkpoints", ckpts[0])))
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors", "export"} <= names
    assert os.path.isdir(os.path.join(run_dirs[0], "export"))
    assert_same_as_single(run_dirs, single)


def test_logdir_per_machine_exact_resume(tmp_path, single):
    run_dirs, _ = kill_and_resume([tmp_path / "m0", tmp_path / "m1"])
    for rank, d in enumerate(run_dirs):  # a complete checkpoint for its own ranks on each machine
        ckpt = os.path.join(d, "checkpoints", f"checkpoint_{EPOCHS:05d}")
        names = set(os.listdir(ckpt))
        assert {"model.safetensors", "optimizer.bin", "run_meta.json", f"random_states_{rank}.pkl"} <= names
        assert f"random_states_{1 - rank}.pkl" not in names
        assert ("export" in names) == (rank == 0)  # the export is the main process's (machine 0's) only
    assert os.path.isfile(os.path.join(run_dirs[0], "run.json")) and not os.path.exists(
        os.path.join(run_dirs[1], "run.json"))  # the wandb id: rank 0's
    assert_same_as_single(run_dirs, single)


SLOW = pytest.mark.skipif(not os.environ.get("DDPO_GRPO_MULTINODE_SLOW"),
                          reason="slower variants (about 40 s each on 2 idle cores): set DDPO_GRPO_MULTINODE_SLOW=1")


@SLOW
def test_two_processes_per_machine_logdir_per_machine(tmp_path):
    """2 machines x 2 processes, a logdir per machine: each machine's first process writes its copy, the second only
    its RNG state; every epoch before the kill is bit-identical to 4 processes on one machine, and so are keys,
    rewards and advantages after the resume. Weights after the resume match to summation order only: DDP rebuilds its
    gradient buckets after the first backward of every process start, so a resumed run's first all-reduce groups
    gradients differently, and a ring all-reduce of 4 ranks then adds them in another order (~1e-14 relative; with
    2 ranks a + b is the same either way). A one-machine 4-process resume differs from its uninterrupted run alike."""
    single = single_machine(tmp_path / "single", 4)
    run_dirs, at = kill_and_resume([tmp_path / "m0", tmp_path / "m1"], per_machine=2)
    for machine, d in enumerate(run_dirs):
        names = set(os.listdir(os.path.join(d, "checkpoints", f"checkpoint_{EPOCHS:05d}")))
        ranks = {2 * machine, 2 * machine + 1}
        assert {n for n in names if n.startswith("random_states_")} == {f"random_states_{r}.pkl" for r in ranks}
        assert {"model.safetensors", "optimizer.bin", "run_meta.json"} <= names
    assert_same_as_single(run_dirs, single, nproc=4, rounding_from=at)


@SLOW
def test_fsdp2_shared_logdir_exact_resume(tmp_path):
    """FSDP2 (really sharded on CPU: tests/fsdp_cpu_train.py), 2 machines x 1 process, a shared logdir: the kill and
    resume end bit-identical to FSDP2 with 2 processes on one machine (a 2-rank reduce-scatter adds a + b either
    way), from the sharded checkpoint every process wrote its shard of."""
    single = single_machine(tmp_path / "single", 2, fsdp=True)
    run_dirs, _ = kill_and_resume([tmp_path / "shared", tmp_path / "shared"], fsdp=True)
    assert os.path.isdir(os.path.join(run_dirs[0], "checkpoints", f"checkpoint_{EPOCHS:05d}", "pytorch_model_fsdp_0"))
    assert_same_as_single(run_dirs, single)


def test_fsdp2_without_shared_logdir_is_one_line(tmp_path):
    """FSDP2's sharded checkpoints need one filesystem: a logdir per machine stops both at start, in one line."""
    outs, rcs = two_machines([tmp_path / "m0", tmp_path / "m1"], fsdp=True)
    for out, rc in zip(outs, rcs):
        assert rc != 0 and "FSDP2's sharded checkpoints need one filesystem" in out, out[-3000:]
        assert "Traceback" not in out[:out.index("error: ")]


def test_peer_dead_before_start_ends_with_one_line(tmp_path):
    """Machine 1's trainer stops at its own start-up check (a resume folder it lacks) before the process group
    forms: machine 0 waits collective_timeout_s for it, then ends with one line, no hang."""
    outs, rcs = two_machines([tmp_path, tmp_path], extra=[["--config.collective_timeout_s=8"],
                                                             [f"--config.resume_from={tmp_path}/missing"]])
    assert rcs[1] != 0 and "error: resume_from=" in outs[1]
    line = "error: another process of this 2-process job stopped or did not answer within collective_timeout_s=8 s"
    assert rcs[0] != 0 and line in outs[0], outs[0][-3000:]
    assert "Traceback" not in outs[0][:outs[0].index(line)]  # the trainer's one line (torchrun's summary follows)


def test_filesystem_layout():
    """{machine's main rank: machines whose token it sees} -> shared, one per machine, or one line."""
    from ddpo_grpo.errors import ConfigError
    from ddpo_grpo.trainer.run.run_identity import filesystem_layout

    assert filesystem_layout({0: (0, 8), 8: (0, 8)}) is True
    assert filesystem_layout({0: (0,)}) is True
    assert filesystem_layout({0: (0,), 8: (8,)}) is False
    with pytest.raises(ConfigError, match="shared by some machines but not all"):
        filesystem_layout({0: (0, 8), 8: (0, 8), 16: (16,)})


def test_lost_peer_line():
    """Which failures are a lost peer (one line) and which keep their traceback."""
    import types

    import torch.distributed as dist

    from ddpo_grpo.trainer.run.devices import lost_peer_line

    cfg = types.SimpleNamespace(collective_timeout_s=30)
    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:38307: Connection reset by peer. This is typically caused by ...")
    line = lost_peer_line(gloo, cfg, 16)
    assert line.startswith("another process of this 16-process job stopped or did not answer within "
                           "collective_timeout_s=30 s (RuntimeError: [") and "\n" not in line
    assert "resume_from" in lost_peer_line(dist.DistStoreError("wait timeout after 8000ms, keys: /default_pg/0"), cfg, 2)
    assert lost_peer_line(gloo, cfg, 1) is None  # one process: nothing to lose
    assert lost_peer_line(RuntimeError("CUDA out of memory"), cfg, 2) is None
    assert lost_peer_line(ValueError("Connection reset by peer"), cfg, 2) is None
    closed = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed "
                          "by peer [127.0.0.1]:12345")
    timed_out = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed "
                             "out waiting 10000ms for recv operation to complete")
    nccl_timeout = dist.DistBackendError("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
                                         "OpType=ALLREDUCE) ran for 1800000 milliseconds before timing out.")
    nccl_abort = dist.DistBackendError("NCCL communicator was aborted on rank 0.")
    for lost in (closed, timed_out, nccl_timeout, nccl_abort, dist.DistNetworkError("Connection reset by peer")):
        assert lost_peer_line(lost, cfg, 2) is not None, lost


def test_a_local_distributed_error_keeps_its_traceback():
    """A failure of this process itself inside a collective (every process may hit it: an op gloo lacks, NCCL running
    out of GPU memory, a bad interface at start) is not a lost peer: telling the user that another process stopped and
    that the first failure is in the other machines' logs would send them to the wrong log, and os._exit would drop
    the traceback that shows where it failed."""
    import types

    import torch.distributed as dist

    from ddpo_grpo.trainer.run.devices import lost_peer_line

    cfg = types.SimpleNamespace(collective_timeout_s=30)
    local = (RuntimeError("ProcessGroupGloo::allreduce: unsupported layout"),
             RuntimeError("[enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/device.cc:84] "
                          "ifa != nullptr. Unable to find address for: eth7"),
             dist.DistBackendError("NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp:268, unhandled "
                                   "cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
                                   "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure "
                                   "'out of memory'"),
             RuntimeError("c10d::allreduce_() Expected a CPU tensor for gloo"),
             RuntimeError("CUDA error: the launch timed out and was terminated"))  # this GPU's own watchdog
    for e in local:
        assert lost_peer_line(e, cfg, 2) is None, e


def test_fsdp2_without_shared_logdir_is_refused_when_the_hacking_guard_may_save(tmp_path, monkeypatch):
    """train.hacking_guard="stop" saves a checkpoint when its alarm fires, whatever save_freq says (scripts/train.py):
    under FSDP2 on run folders that are not shared that checkpoint would be split over the machines (each process's
    shard on its own, the index on machine 0's) and could not be resumed, so agree_run refuses it as it refuses
    save_freq > 0. With save_freq=0 and no guard that stops, nothing is saved and the run goes on."""
    import types

    from config import base

    from ddpo_grpo.errors import ConfigError
    from ddpo_grpo.trainer.run import run_identity

    monkeypatch.setattr(run_identity, "broadcast", lambda obj, acc: obj)  # two machines' processes, as one
    monkeypatch.setattr(run_identity, "_detect_shared", lambda acc, run_dir, nonce: False)  # a logdir per machine
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    acc = types.SimpleNamespace(num_processes=2, is_main_process=True)
    config = base.get_config()
    config.logdir, config.run_name, config.save_freq = str(tmp_path), "r", 0
    config.train.hacking_guard = "warn"
    assert run_identity.agree_run(acc, config, "", "default", "ddim").shared is False
    config.train.hacking_guard = "stop"
    with pytest.raises(ConfigError, match="FSDP2's sharded checkpoints need one filesystem"):
        run_identity.agree_run(acc, config, "", "default", "ddim")
