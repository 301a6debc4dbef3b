"""Model adapters as plugins (models/registry.py): a package outside this project, installed nowhere (a folder with a
.dist-info/entry_points.txt on the path), adds a pipeline class under the entry-point group ddpo_grpo.models; the
trainer runs it from scripts/train.py on-policy and exports through its hooks; a broken plugin is one line, exit 2."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import ROOT, cpu_env, run_side_by_side
from safetensors.torch import load_file

from ddpo_grpo.core.loss import ONPOLICY_TOL_EXACT
from ddpo_grpo.errors import ConfigError
from ddpo_grpo.models import model_adapter, resolve_model_path
from ddpo_grpo.models.base import adapter_for, register
from ddpo_grpo.models.registry import ENTRY_POINT_GROUP, supported_classes, unregister

OWN = {"StableDiffusionPipeline": "sd", "StableDiffusionXLPipeline": "sdxl", "StableDiffusion3Pipeline": "sd3",
       "FluxPipeline": "flux", "WanPipeline": "wan"}

# The worked example of docs/models.md: a renamed pipeline class reusing Stable Diffusion's adapter, plus the export
# hooks, whose output the tests read to know that this adapter (not ours) ran. Its load and encode also leave a
# trace of the training path itself (what the export hooks cannot show): `load` hooks the denoiser it returns and
# counts its forward calls with and without autograd (sampling runs without, the update with), `encode` counts the
# prompts it encoded; at exit the counts go to $MY_T2I_TRACE (when set).
PLUGIN = textwrap.dedent('''
    import atexit, json, os

    import torch

    from ddpo_grpo.models.sd import SDAdapter

    TRACE = {"loads": 0, "prompts_encoded": 0, "denoiser_calls_no_grad": 0, "denoiser_calls_grad": 0}


    def _dump():
        if os.environ.get("MY_T2I_TRACE"):
            with open(os.environ["MY_T2I_TRACE"], "w") as f:
                json.dump(TRACE, f)


    atexit.register(_dump)


    def _count(module, args, output):
        TRACE["denoiser_calls_grad" if torch.is_grad_enabled() else "denoiser_calls_no_grad"] += 1


    class MyT2IAdapter(SDAdapter):
        name = "my_t2i"

        def load(self, *args, **kwargs):
            pipe = super().load(*args, **kwargs)
            TRACE["loads"] += 1
            pipe.unet.register_forward_hook(_count)
            return pipe

        def encode(self, pipe, prompts):
            TRACE["prompts_encoded"] += len(prompts)
            return super().encode(pipe, prompts)

        def export_settings(self, pipe):
            return dict(super().export_settings(pipe), my_adapter=self.name)

        def write_extra(self, pipe, unet, state, out_dir, lora):
            with open(os.path.join(out_dir, "my_t2i.json"), "w") as f:
                json.dump({"lora": lora, "tensors": sorted(state)}, f)


    ADAPTER = MyT2IAdapter()
    NOT_AN_ADAPTER = {"load": None}
''')
ENTRIES = {
    "MyT2IPipeline": "my_t2i_adapter:ADAPTER",
    "BrokenPipeline": "my_broken_adapter:ADAPTER",  # its module imports a package that is not there
    "DictPipeline": "my_t2i_adapter:NOT_AN_ADAPTER",
    "ClassPipeline": "my_t2i_adapter:MyT2IAdapter",  # the class, not an instance
    "StableDiffusionPipeline": "my_t2i_adapter:ADAPTER",  # ours is not taken over
}
RUN = ["--config.sample.num_steps=4", "--config.sample.batch_size=4", "--config.sample.num_batches_per_epoch=2",
       "--config.sample.k=4", "--config.train.batch_size=4", "--config.eval_freq=0", "--config.logging.wandb=False",
       "--config.logging.tensorboard=False", "--config.logging.image_freq=0", "--config.train.timestep_fraction=1.0",
       "--config.num_epochs=1", "--config.save_freq=1", "--config.train.learning_rate=3e-3", "--config.use_lora=False"]


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> str:
    """The outside package's folder (for sys.path / PYTHONPATH): its modules and its dist-info."""
    folder = tmp_path_factory.mktemp("plugin")
    (folder / "my_t2i_adapter.py").write_text(PLUGIN)
    (folder / "my_broken_adapter.py").write_text("import my_missing_dependency  # noqa: F401\nADAPTER = None\n")
    info = folder / "my_t2i_adapter-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-t2i-adapter\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n" +
                                           "".join(f"{k} = {v}\n" for k, v in ENTRIES.items()))
    return str(folder)


def folder_of(tmp, cls: str, copy: bool = False) -> str:
    """A model folder whose model_index.json names `cls`: the bundled tiny-t2i's components (copied when it is to be
    loaded), else only the index (enough to choose an adapter)."""
    path = os.path.join(str(tmp), cls)
    if copy:
        shutil.copytree(resolve_model_path("tiny-t2i"), path)
    else:
        os.makedirs(path)
    with open(os.path.join(path, "model_index.json"), "w") as f:
        json.dump({"_class_name": cls, "_diffusers_version": "0.30.0"}, f)
    return path


@pytest.fixture
def on_path(plugin, monkeypatch):
    monkeypatch.syspath_prepend(plugin)
    yield
    for m in ("my_t2i_adapter", "my_broken_adapter"):
        sys.modules.pop(m, None)


def test_our_adapters_are_entry_points_and_a_folder_without_an_index_is_sd(tmp_path):
    import importlib

    assert set(OWN) <= set(supported_classes())
    for cls, module in OWN.items():
        assert adapter_for(folder_of(tmp_path, cls)) is importlib.import_module(f"ddpo_grpo.models.{module}").ADAPTER
    assert model_adapter("tiny-t2i") is importlib.import_module("ddpo_grpo.models.sd").ADAPTER  # no model_index.json


def test_plugin_classes_are_found_listed_and_bad_ones_are_one_line(tmp_path, on_path):
    from my_t2i_adapter import ADAPTER

    from ddpo_grpo.models.sd import ADAPTER as SD

    assert adapter_for(folder_of(tmp_path, "MyT2IPipeline")) is ADAPTER
    assert adapter_for(folder_of(tmp_path, "StableDiffusionPipeline")) is SD  # ours wins a name declared twice
    with pytest.raises(ConfigError) as e:
        adapter_for(folder_of(tmp_path, "CogVideoXPipeline"))
    msg = str(e.value)
    assert "is a CogVideoXPipeline; supported pipeline classes: " in msg and "\n" not in msg
    listed = msg.split("supported pipeline classes: ")[1].split(" (")[0].split(", ")
    assert set(OWN) | set(ENTRIES) <= set(listed) and len(listed) == len(set(listed)) and listed == sorted(listed)
    assert f"'{ENTRY_POINT_GROUP}'" in msg
    want = {
        "BrokenPipeline": "whose adapter plugin 'BrokenPipeline = my_broken_adapter:ADAPTER' (distribution "
                          "my-t2i-adapter) cannot be imported: ModuleNotFoundError: No module named "
                          "'my_missing_dependency'",
        "DictPipeline": "whose adapter plugin 'DictPipeline = my_t2i_adapter:NOT_AN_ADAPTER' (distribution "
                        "my-t2i-adapter) is a dict, not a ddpo_grpo.models.base.ModelAdapter instance",
        "ClassPipeline": "is the class MyT2IAdapter; the entry point names an instance of it",
    }
    for cls, text in want.items():
        with pytest.raises(ConfigError) as e:
            adapter_for(folder_of(tmp_path, cls))
        assert text in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_register_in_process_wins_and_is_removed(tmp_path):
    from ddpo_grpo.models.sd import SDAdapter

    mine = SDAdapter()
    register("StableDiffusionPipeline", mine)
    try:
        assert model_adapter("tiny-t2i") is mine
    finally:
        unregister("StableDiffusionPipeline")
    assert model_adapter("tiny-t2i") is not mine
    with pytest.raises(TypeError, match="takes a ModelAdapter instance"):
        register("X", "my_pkg.adapter")


@pytest.mark.timeout(240)
def test_plugin_trains_on_policy_and_exports_and_a_broken_one_is_one_line(plugin, tmp_path):
    env = cpu_env(PYTHONPATH=os.pathsep.join(p for p in (plugin, os.environ.get("PYTHONPATH", "")) if p),
                  MY_T2I_TRACE=str(tmp_path / "trace.json"))  # only "mine" loads the plugin's module: its trace
    mine, broken = folder_of(tmp_path, "MyT2IPipeline", copy=True), folder_of(tmp_path, "BrokenPipeline", copy=True)
    jobs = [dict(args=[sys.executable, "scripts/train.py", "--config", "config/grpo.py:tiny", f"--config.logdir={tmp_path}",
                       f"--config.run_name={name}", f"--config.pretrained.model={model}", *RUN], cwd=ROOT, env=env)
            for name, model in (("mine", mine), ("broken", broken))]
    ok, bad = run_side_by_side(jobs)

    assert bad.returncode == 2, bad.stdout[-2000:] + bad.stderr[-2000:]
    errors = [ln for ln in bad.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    assert errors[0].endswith("is a BrokenPipeline, whose adapter plugin 'BrokenPipeline = my_broken_adapter:ADAPTER' "
                              "(distribution my-t2i-adapter) cannot be imported: ModuleNotFoundError: No module named "
                              "'my_missing_dependency'"), errors[0]
    assert not os.path.exists(tmp_path / "broken" / "checkpoints")  # stopped before anything was trained

    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    run = tmp_path / "mine"
    (h,) = json.load(open(run / "summary.json"))["history"]
    # on-policy within float32's stated tolerance (the sampler's log-probs, rows in other calls), and it trained
    assert h["train"]["onpolicy_ratio_max_dev"] < ONPOLICY_TOL_EXACT and h["train"]["grad_norm"] > 0
    # Training went through the plugin's adapter: its load built the denoiser that sampled (calls without autograd)
    # and that the update differentiated (calls with autograd), its encode made the prompts' conditions. The counts
    # depend on implementation details (batching, re-scoring), so only "some of each": with our SD adapter in its
    # place (a registry that fell back to the default) there is no trace at all.
    assert (tmp_path / "trace.json").is_file(), "the plugin's adapter never ran in the training process"
    trace = json.load(open(tmp_path / "trace.json"))
    assert trace["loads"] >= 1 and trace["prompts_encoded"] > 0, trace
    assert trace["denoiser_calls_no_grad"] > 0 and trace["denoiser_calls_grad"] > 0, trace
    export = run / "export"
    assert sorted(os.listdir(export)) == ["export.json", "my_t2i.json", "scheduler", "text_encoder", "tokenizer", "unet"]
    assert json.load(open(export / "export.json"))["my_adapter"] == "my_t2i"  # the plugin's export_settings
    trained = load_file(str(export / "unet" / "diffusion_pytorch_model.safetensors"))
    extra = json.load(open(export / "my_t2i.json"))  # the plugin's write_extra got the exported state
    assert extra == {"lora": False, "tensors": sorted(trained)}
    base = load_file(os.path.join(mine, "unet", "diffusion_pytorch_model.safetensors"))
    assert sorted(base) == sorted(trained)
    assert max((trained[k].float() - base[k].float()).abs().max().item() for k in base) > 1e-4  # the update is in it
    state = load_file(str(run / "checkpoints" / "checkpoint_00001" / "model.safetensors"))
    assert all(torch.equal(state[k], trained[k]) for k in trained)  # the export is the trained policy


def test_a_model_index_without_a_class_name_is_one_line(tmp_path):
    """An SD3 folder whose model_index.json lost `_class_name`: not read as Stable Diffusion (which ended in an OSError
    traceback inside diffusers, exit 1) but one line naming the supported classes, from the library and the trainer."""
    folder = tmp_path / "sd3-no-class"
    shutil.copytree(resolve_model_path("sd3-tiny"), folder)
    index = json.loads((folder / "model_index.json").read_text())
    assert index.pop("_class_name") == "StableDiffusion3Pipeline"
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError) as e:
        model_adapter(str(folder))
    msg = str(e.value)
    assert "\n" not in msg and "model_index.json names no pipeline class (`_class_name`)" in msg
    assert set(OWN) <= set(msg.split("one of the supported: ")[1].split(", "))
    p = subprocess.run([sys.executable, "scripts/train.py", "--config", "config/grpo.py:sd3_tiny",
                        f"--config.pretrained.model={folder}", f"--config.logdir={tmp_path}"], cwd=ROOT, env=cpu_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == f"error: {msg}"
