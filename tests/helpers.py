"""Small models for tests (built in memory, random weights, seeded), the launch line of multi-process runs, and
independent subprocesses run side by side."""
import ctypes
import gc
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Sequence

import pytest
import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler, UNet2DConditionModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the bundled tiny builds of each architecture, their sizes where the default does not fit, and prompts with the
# empty one (CFG's negative) and a duplicate (memory switches, embedding cache)
FAMILIES = ["tiny-t2i", "sdxl-tiny", "sd3-tiny", "flux-tiny", "wan-tiny"]
SIZE = {"wan-tiny": dict(resolution=32, num_frames=5)}  # the tiny transformer's rope covers 32 px
PROMPTS = ["a red circle on the left", "", "a blue square", "a red circle on the left"]


def tiny_unet(in_channels: int = 3, seed: int = 0) -> UNet2DConditionModel:
    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=8, in_channels=in_channels, out_channels=3, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=8, attention_head_dim=4, norm_num_groups=4,
    ).eval()


def ddim_scheduler(prediction_type: str = "v_prediction") -> DDIMScheduler:
    return DDIMScheduler(beta_schedule="squaredcos_cap_v2", prediction_type=prediction_type, clip_sample=False,
                         set_alpha_to_one=False, steps_offset=1)


def flow_scheduler() -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(shift=3.0)


def python_for_shell(env: dict) -> dict:
    """PYTHON=... (and what it needs) for a shell script a test runs with `env` that calls "$PYTHON": the suite's
    fork server's stand-in (tests/served_python) where conftest has a server for env, else this interpreter."""
    import conftest

    if env.get("DDPO_GRPO_TEST_FORK", os.environ.get("DDPO_GRPO_TEST_FORK", "1")) == "0":
        return {"PYTHON": sys.executable}  # decided before asking for a server: none is started for it
    path = conftest._fork_server(env) if hasattr(conftest, "_fork_server") else None
    if path is None:
        return {"PYTHON": sys.executable}
    return {"PYTHON": os.path.join(os.path.dirname(os.path.abspath(__file__)), "served_python"),
            "DDPO_GRPO_PYTHON": sys.executable, "DDPO_GRPO_FORKSERVER": path}


def cpu_env(**extra) -> dict:
    """Environment for a trainer subprocess pinned to CPU (+ gloo when several processes), whatever the machine
    has: multi-process tests check the logic, not the device, and N ranks on one GPU would stop inside NCCL.
    ACCELERATE_USE_CPU makes the trainer ask accelerate for CPU; an empty CUDA_VISIBLE_DEVICES hides GPUs from
    everything else in the child (torch, accelerate launch itself)."""
    return dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1",
                CUDA_VISIBLE_DEVICES="", **extra)


def launch_cmd(nproc: int, port_base: int) -> List[str]:
    """`accelerate launch` for nproc CPU processes, up to the script name. accelerate's own --cpu flag would start
    a single process, so several go through --multi_gpu (torchrun) with cpu_env()'s ACCELERATE_USE_CPU."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(nproc), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no"]
    if nproc > 1:
        cmd += ["--multi_gpu", "--main_process_port", str(port_base + os.getpid() % 1000)]
    return cmd


def reward_plugin(folder, name: str, source: str) -> str:
    """Write a reward plugin found through the `ddpo_grpo.rewards` entry-point group and installed nowhere: module
    `<name>_reward.py` (source, with a factory `make`) plus its dist-info. Returns the folder for PYTHONPATH."""
    (folder / f"{name}_reward.py").write_text(source)
    info = folder / f"{name}_reward-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-reward\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[ddpo_grpo.rewards]\n{name} = {name}_reward:make\n")
    return str(folder)


def run_side_by_side(jobs: Sequence[Dict], timeout: float = 600) -> List[subprocess.CompletedProcess]:
    """subprocess.run(**job, capture_output=True, text=True) for each job, up to one per CPU core at a time; results in
    the jobs' order. For independent single-threaded children (OMP_NUM_THREADS=1, one process each): one at a time
    they leave every other core idle, so on a 2-core machine two side by side take about the time of one. Each
    test still asserts on its own child's result."""
    def run(job):
        return subprocess.run(**job, capture_output=True, text=True, timeout=timeout)

    with ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        return list(pool.map(run, jobs))


def selected_params(request, values: Sequence[str]) -> List[str]:
    """The values of a parametrized test in the requesting fixture's module that this session will run (node ids
    ending in [value]), so that a module fixture running all of them side by side runs only those under -k."""
    return [v for v in values if any(getattr(item, "module", None) is request.module and item.nodeid.endswith(f"[{v}]")
                                     for item in request.session.items)]


def narrow_sd15(monkeypatch, sd) -> None:
    """Narrow widths for models.sd15_random's builder (module `sd`), its layout kept: the seeding and dtypes it tests do
    not depend on widths, and a build of SD 1.5's 1.07 G parameters would cost more than the tests around it."""
    unet_cfg, vae_cfg, text_cfg = sd.sd15_unet_config, sd.sd15_vae_config, sd.sd15_text_config
    monkeypatch.setattr(sd, "sd15_unet_config", lambda n: {**unet_cfg(n), "block_out_channels": (32, 32, 64, 64),
                                                           "cross_attention_dim": 32, "norm_num_groups": 8})
    monkeypatch.setattr(sd, "sd15_vae_config", lambda r: {**vae_cfg(r), "block_out_channels": (8, 8, 16, 16),
                                                          "norm_num_groups": 8})

    def narrow_text(tokenizer):
        c = text_cfg(tokenizer)
        c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads = 32, 64, 2, 2
        return c

    monkeypatch.setattr(sd, "sd15_text_config", narrow_text)


def train_modes(tmp, config_name: str, cache: str, run_args: Sequence[str], modes: Dict[str, Sequence[str]]):
    """One trainer run of config/grpo.py:<config_name> per mode (run folder tmp/<mode>, the mode's extra flags after
    run_args), side by side, with the tiny builds cached in `cache`; each must exit 0. Returns tmp."""
    env = cpu_env(DDPO_GRPO_TINY_CACHE=cache)
    jobs = [dict(args=[sys.executable, "scripts/train.py", "--config", f"config/grpo.py:{config_name}",
                       f"--config.logdir={tmp}", f"--config.run_name={mode}", *run_args, *extra], cwd=ROOT, env=env)
            for mode, extra in modes.items()]
    for res in run_side_by_side(jobs):
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return tmp


def policy_from_checkpoint(model: str, ckpt: str, lora: bool, **load_kw):
    """The trained policy as the trainer holds it: `model` loaded (load_pipeline(model, **load_kw)), made trainable as
    the trainer does (LoRA rank 4 or full), and the checkpoint's training-state model.safetensors loaded strictly."""
    from ml_collections import ConfigDict
    from safetensors.torch import load_file

    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.trainer.run.build import make_trainable

    pipe = load_pipeline(model, **load_kw)
    make_trainable(pipe.unet, ConfigDict(dict(use_lora=lora, lora_rank=4, train=dict(
        learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_weight_decay=0.0, adam_epsilon=1e-8))),
        pipe.adapter.lora_target_modules)
    pipe.unet.load_state_dict(load_file(os.path.join(ckpt, "model.safetensors")), strict=True)
    return pipe


# Plain diffusers, nothing of ours, and nothing passed by hand but the prompts and the seeds: each export's own files
# and export.json decide the pipeline (DiffusionPipeline reads model_index.json: the export's own, or for a LoRA its
# base's), the scheduler (the export's scheduler/), the weights and every sampling setting (export.json's
# pipeline_call: steps, CFG, size, frames, embedded guidance, eta); the noise is one seeded generator per sample, as
# the trainer's eval draws it. Writes {export: {"samples", "pipeline", "scheduler"}, "loaded": ddpo modules imported}.
PLAIN_EXPORT = r'''
import json, sys, torch, diffusers
data, results = torch.load(sys.argv[1]), {}
for export in sys.argv[3:]:
    info = json.load(open(f"{export}/export.json"))
    scheduler = getattr(diffusers, info["scheduler"]).from_pretrained(export, subfolder="scheduler")
    pipe = diffusers.DiffusionPipeline.from_pretrained(info["base_model_path"] if info["lora"] else export,
                                                       scheduler=scheduler)
    if info["lora"]:
        pipe.load_lora_weights(export)
    with torch.no_grad():
        out = pipe(prompt=data["prompts"], generator=[torch.Generator().manual_seed(s) for s in data["seeds"]],
                   output_type="pt", **info["pipeline_call"])
    results[export] = {"samples": out.frames if hasattr(out, "frames") else out.images,
                       "pipeline": type(pipe).__name__, "scheduler": type(pipe.scheduler).__name__}
results["loaded"] = sorted(m for m in sys.modules if m.startswith("ddpo"))
torch.save(results, sys.argv[2])
'''


def start_plain_export(exports, prompts, seeds, tmp_path, env) -> subprocess.Popen:
    """PLAIN_EXPORT over `exports` in a fresh process (output to tmp_path/plain.log), running while the caller samples
    the policy; finish_plain_export collects it."""
    torch.save({"prompts": list(prompts), "seeds": list(seeds)}, tmp_path / "plain_data.pt")
    log = open(tmp_path / "plain.log", "w")  # a file: a pipe nobody reads while the child runs would fill
    return subprocess.Popen([sys.executable, "-c", PLAIN_EXPORT, str(tmp_path / "plain_data.pt"),
                             str(tmp_path / "plain_out.pt"), *(str(e) for e in exports)],
                            cwd=str(tmp_path), env=env, stdout=log, stderr=subprocess.STDOUT)


def finish_plain_export(proc: subprocess.Popen, tmp_path, timeout: float = 180) -> dict:
    proc.wait(timeout=timeout)
    assert proc.returncode == 0, (tmp_path / "plain.log").read_text()[-3000:]
    got = torch.load(tmp_path / "plain_out.pt")
    assert got["loaded"] == []  # plain diffusers: nothing of ddpo_grpo was imported
    return got


def write_mp4(path, frames_u8, fps=15):
    """An mp4 written with PyAV directly (not the library's writer, so a reader test does not read its own output):
    (F, H, W, 3) uint8."""
    import av

    with av.open(str(path), "w") as c:
        st = c.add_stream("libx264", rate=fps)
        st.height, st.width, st.pix_fmt = frames_u8.shape[1], frames_u8.shape[2], "yuv420p"
        for f in frames_u8:
            for p in st.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in st.encode():
            c.mux(p)


def grpo_configs():
    """config/grpo.py, loaded by path as scripts/train.py's --config loads it (its CONFIGS index, get_config)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("grpo_configs_tests", os.path.join(ROOT, "config", "grpo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def named_config(name: str = "tiny"):
    """A named config as `--config config/grpo.py:NAME` builds it."""
    return grpo_configs().get_config(name)


# ------------------------------------------------------------------ heap measurements (memory plan, byte meters)
class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_in_use():
    """Bytes in use on glibc's heap (mallinfo2: small chunks + mmapped ones), where torch's CPU tensors live."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        pytest.skip("glibc's mallinfo2 is not available here")

    def used():
        gc.collect()
        m = libc.mallinfo2()
        return m.uordblks + m.hblkhd

    return used


_HEAP_CHILD_RESULTS: Dict[str, Dict[str, str]] = {}  # a test module's path -> {nodeid: "" when it passed, else why}


def fresh_process(request) -> bool:
    """True when the calling heap test should return: it has been run again in a fresh Python process (and asserted
    there). glibc's heap is the whole process's: other tests' threads (reward pools, data loaders) and their freed
    arenas would otherwise move it between the two readings. One child per test module runs all of the module's heap
    tests that this session selected (the tests that call fresh_process), one after the other: none starts a thread,
    and each reads heap in use, not the arena's size, so the one before it moves nothing; a child per test cost a
    pytest start (~9 s of imports) each."""
    import xml.etree.ElementTree as ET

    if os.environ.get("DDPO_HEAP_TEST_CHILD") == "1":
        return False
    module = str(request.node.path)
    if module not in _HEAP_CHILD_RESULTS:
        heap_tests = [item.nodeid for item in request.session.items if str(item.path) == module
                      and "fresh_process" in getattr(getattr(item, "function", None), "__code__", ()).co_names]
        env = dict(os.environ, DDPO_HEAP_TEST_CHILD="1", PYTHONPATH=ROOT)
        report = os.path.join(request.getfixturevalue("tmp_path_factory").mktemp("heap"), "junit.xml")
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                              f"--junitxml={report}", *heap_tests], capture_output=True, text=True, env=env, cwd=ROOT,
                             timeout=900)
        results = {}
        if os.path.exists(report):
            for case in ET.parse(report).getroot().iter("testcase"):
                name = f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"
                bad = [c for c in case if c.tag in ("failure", "error", "skipped")]
                results[name] = "" if not bad else f"{bad[0].tag}: {bad[0].get('message')}\n{bad[0].text or ''}"
        missing = [t for t in heap_tests if t not in results]
        assert not missing, (missing, out.stdout[-3000:] + out.stderr[-2000:])
        _HEAP_CHILD_RESULTS[module] = results
    result = _HEAP_CHILD_RESULTS[module][request.node.nodeid]
    if result.startswith("skipped:"):
        pytest.skip(f"{result.splitlines()[0]} (fresh process)")
    assert result == "", result[-4000:]
    return True


def mid_unet_config(latent: int, channels=(64, 128, 128, 128)) -> dict:
    """SD 1.5's UNet layout (sd15_random) at a CPU-friendly width: 12.8 M parameters."""
    from ddpo_grpo.models.sd15_random import sd15_unet_config

    return dict(sd15_unet_config(latent), block_out_channels=channels, cross_attention_dim=64, attention_head_dim=8,
                norm_num_groups=16)
