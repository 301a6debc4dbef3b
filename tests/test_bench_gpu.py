"""scripts/bench_gpu.py without a GPU: the plan of a dry run (every model's config validated), one-line refusals
(exit 2), the FLOPs per row it counts on meta-device builds against the models' shapes, and one benchmark point of
a built model (models.BUILT) run end to end on CPU with a tiny SD3 registered in its place. CUDA is hidden from the children so that the refusals are
tested on GPU machines too. (A CPU run of an sd15-random point takes ~2 min: two SD-sized model builds and four
epochs; it was run by hand, see docs/performance.md.)"""
import importlib.util
import math
import os
import re
import sys

import pytest
import torch

from helpers import python_for_shell, run_side_by_side

from ddpo_grpo.trainer.checks.meta_counts import denoiser_inputs
from ddpo_grpo.models.sd3 import ADAPTER  # noqa: F401  (build_sd3_tiny's architecture, as models.model_adapter asks)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")


def bench(*arg_lists):
    """scripts/bench_gpu.py once per argument list, side by side (independent single-threaded processes)."""
    return run_side_by_side([dict(args=[sys.executable, "scripts/bench_gpu.py", *args], cwd=ROOT, env=ENV)
                             for args in arg_lists], timeout=300)


def test_dry_run_plans_the_grid_and_validates_every_config():
    p, p2, p3 = bench(["--dry-run"], ["--dry-run", "--batch-sizes", "8", "--cfg", "on", "--modes", "full", "--switches",
                                      "all"], ["--dry-run", "--all-models"])
    # one point per model at its named config's batch and CFG (FLUX.1-dev: embedded guidance, no CFG), each validated
    assert p3.returncode == 0, p3.stderr[-2000:]
    assert p3.stdout.strip().splitlines()[-1] == (
        "plan: 6 points on cpu: sd15-random/lora/B8/cfg-on/none, sdxl-random/lora/B4/cfg-on/none, "
        "sd35-medium-random/lora/B8/cfg-on/none, flux-dev-random/lora/B8/cfg-off/none, wan21-1.3b-random/lora/B2/cfg-on/none, "
        "recam-1.3b-random/lora/B2/cfg-on/none")
    assert p.returncode == 0, p.stderr[-2000:]
    # 2 modes x 3 batch sizes x CFG off/on, no switches
    assert "plan: 12 points on cpu at 512 px: lora/B4/cfg-off/none, lora/B4/cfg-on/none, lora/B8/cfg-off/none" in p.stdout
    assert "full/B16/cfg-on/none" in p.stdout
    p = p2
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().endswith("full/B8/cfg-on/none, full/B8/cfg-on/attention_math, full/B8/cfg-on/channels_last, "
                                     "full/B8/cfg-on/grad_ckpt, full/B8/cfg-on/stack4, full/B8/cfg-on/compile")


def test_refusals_are_one_line_exit_2():
    cases = [
        ((), "error: no CUDA device: this benchmark measures the GPU path"),
        (("--allow-cpu",), "error: --allow-cpu with --resolution 512: on CPU use <= 128"),
        (("--dry-run", "--switches", "fast"), "error: --switches: unknown fast"),
        (("--dry-run", "--modes", "qlora"), "error: --modes 'qlora': choose from lora, full"),
        (("--dry-run", "--resolution", "100"), "error: B=4 cfg=False lora none: pretrained.resolution: resolution 100"),
        (("--dry-run", "--model", "sdxl"), "error: --model 'sdxl': choose one of sd15-random, sdxl-random, "),
        (("--allow-cpu", "--model", "flux-dev-random"), "error: flux-dev-random on CPU: the real-shape builds"),
    ]
    for (args, start), p in zip(cases, bench(*(args for args, _ in cases))):
        assert p.returncode == 2, (args, p.stderr[-2000:])
        assert p.stderr.strip().splitlines()[-1].startswith(start), (args, p.stderr[-500:])
        assert "Traceback" not in p.stderr


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", os.path.join(ROOT, "scripts", "bench_gpu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def args_for(bench_gpu, **kw):
    args = bench_gpu.parse(["--dry-run"] + [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])
    args.device = "cpu"
    return args


def linear_conv_flops(module, run) -> int:
    """2 x rows x in x out per nn.Linear call and 2 x output elements x (in / groups) x kernel per convolution, from the
    modules' shapes, by forward hooks: an independent count of what is not attention."""
    total = []
    hooks = [m.register_forward_hook(lambda m, i, o: total.append(2 * i[0].numel() * m.out_features))
             for m in module.modules() if isinstance(m, torch.nn.Linear)]
    hooks += [m.register_forward_hook(lambda m, i, o: total.append(
        2 * o.numel() * m.in_channels // m.groups * math.prod(m.kernel_size)))
        for m in module.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return sum(total)


def attention(q_tokens, kv_tokens, width) -> int:
    """QK^T and AV of one attention layer: 2 x 2 x Lq x Lkv x width FLOPs."""
    return 4 * q_tokens * kv_tokens * width


def wan_tokens(sample_shape) -> int:
    """Wan's tokens per row: latent frames x (H / 2) x (W / 2) (1x2x2 patches); 480 x 832 px -> 60 x 104 latents, and
    the GPU check's 17 frames -> 5 latent frames (33 -> 9)."""
    _, frames, h, w = sample_shape
    return frames * (h // 2) * (w // 2)


# model -> (denoiser parameters, attention FLOPs per forward row at its config's shapes: the published layouts; Wan's
# a function of its sample shape (C, F, H, W), whose frames the GPU check sets)
REAL = {
    "sdxl-random": (2_567_463_684,  # 10 transformer layers at 64x64 tokens (640 wide), 60 at 32x32 (1280), CLIP 77
                    10 * (attention(4096, 4096, 640) + attention(4096, 77, 640))
                    + 60 * (attention(1024, 1024, 1280) + attention(1024, 77, 1280))),
    "sd35-medium-random": (2_243_171_520,  # 24 joint layers over 32x32 + 77 + 256 tokens, 13 dual image-only ones
                           24 * attention(1357, 1357, 1536) + 13 * attention(1024, 1024, 1536)),
    "flux-dev-random": (11_901_408_320, 57 * attention(1024 + 512, 1024 + 512, 3072)),  # 19 double + 38 single
    "wan21-1.3b-random": (1_418_996_800,  # 30 blocks: self-attention and cross-attention to 512 UMT5 tokens
                          lambda shape: 30 * (attention(wan_tokens(shape), wan_tokens(shape), 1536)
                                              + attention(wan_tokens(shape), 512, 1536))),
}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """scripts/gpu_check.sh --dry-run, once for this module: (its CompletedProcess, $OUT/counts.json or None). ~2-3
    min on 2 cores: the meta builds of six pipelines, which the FLOP tests below read too."""
    import json
    import subprocess

    out = tmp_path_factory.mktemp("dry")
    p = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=dict(ENV, OUT=str(out), **python_for_shell(ENV)))
    counts = out / "counts.json"
    return p, json.loads(counts.read_text()) if counts.exists() else None


def dry_counts(dry_run) -> dict:
    p, counts = dry_run
    assert p.returncode == 0 and counts is not None, (p.stdout[-2000:], p.stderr[-3000:])
    return counts


@pytest.mark.parametrize("model", list(REAL))
def test_flops_per_row_are_the_layers_and_the_attention_of_the_real_shapes(model, dry_run):
    """count_flops (torch's flop counter on a meta-device build at the config's shapes, as the GPU check's dry run
    counts it) = the Linear and convolution FLOPs of the modules' shapes + the closed-form attention FLOPs of the
    published layout, and the denoiser has the published parameter count."""
    from ddpo_grpo.models import load_pipeline

    counted = dry_counts(dry_run)[model]
    bench_gpu = load_bench()
    config = bench_gpu.gpu_check_config(args_for(bench_gpu), model)
    params, attn = REAL[model]
    attn = attn(counted["sample_shape"]) if callable(attn) else attn
    assert counted["denoiser_params"] == params
    pipe = load_pipeline(model, torch.float32, "meta", int(config.pretrained.resolution))
    pipe.adapter.configure(pipe, config)
    x, t, cond = denoiser_inputs(pipe)
    assert counted["sample_shape"] == list(pipe.sample_shape) and counted["condition_shape"] == list(cond.shape[1:])
    with torch.no_grad():
        layers = linear_conv_flops(pipe.unet, lambda: pipe.unet(x, t, encoder_hidden_states=cond))
    assert counted["flops_fwd_row"] == pytest.approx(layers + attn, rel=1e-9)


def test_lora_training_flops_are_input_gradients_plus_attention_backward(dry_run):
    """A LoRA training row: the forward, the input gradient of every frozen layer (as much again) and attention's
    backward (twice its forward, both operands are activations); the adapters add under 1 %."""
    bench_gpu = load_bench()
    model = "sd35-medium-random"
    assert bench_gpu.gpu_check_point(model)[3] == "lora"  # the GPU check's SD3.5 point trains LoRA
    counted = dry_counts(dry_run)[model]
    attn = REAL[model][1]
    layers = counted["flops_fwd_row"] - attn
    assert 2 * layers + 3 * attn < counted["flops_train_row"] < 1.01 * (2 * layers + 3 * attn)


def build_sd3_tiny(device="cpu", torch_dtype=torch.float32, denoiser_dtype=None, resolution=0):
    """A models.BUILDERS builder's signature over the tiny SD3 (for the CPU run of a built model)."""
    from ddpo_grpo.models.sd3 import ADAPTER, tiny_parts

    parts = tiny_parts()
    for name, part in parts.items():
        if isinstance(part, torch.nn.Module):
            dtype = (denoiser_dtype or torch_dtype) if name == "transformer" else torch_dtype
            parts[name] = part.to(device) if dtype == torch.float32 else part.to(device=device, dtype=dtype)
    return ADAPTER.wrap(parts, "flow", "sd3-tiny-built", resolution)


def test_the_benchmarked_models_are_the_librarys_built_models():
    """No registration in the script: every model it runs is a models.BUILT name the trainer loads (the real-shape
    ones refused on a CPU by the script and the loader alike), with the family of its named config's sampler."""
    import ddpo_grpo.models as models

    bench_gpu = load_bench()
    assert set(bench_gpu.MODELS) == set(models.BUILT) == set(models.BUILDERS)
    assert set(models.GPU_ONLY) == set(models.BUILT) - {"sd15-random"}
    assert {m: models.BUILT[m] for m in bench_gpu.MODELS} == {
        "sd15-random": "ddim", "sdxl-random": "ddim", "sd35-medium-random": "flow", "flux-dev-random": "flow",
        "wan21-1.3b-random": "flow", "recam-1.3b-random": "flow"}


def tiny_sd3_point(monkeypatch, num_steps: int, B: int, cfg: bool):
    """(the script, its measured row) of one LoRA point of the tiny SD3 registered as a models.BUILT name, one sampling
    batch of `num_steps` steps, on CPU; the row has no error."""
    import ddpo_grpo.models as models

    bench_gpu = load_bench()
    monkeypatch.setitem(models.BUILT, "sd3-tiny-built", "flow")  # (setitem: removed again after the test)
    monkeypatch.setitem(models.BUILDERS, "sd3-tiny-built", "test_bench_gpu:build_sd3_tiny")
    monkeypatch.setitem(bench_gpu.MODELS, "sd3-tiny-built", "sd3_tiny")
    args = args_for(bench_gpu, model="sd3-tiny-built", num_steps=num_steps, num_batches=1, out="unused")
    args.dry_run = False
    row = bench_gpu.measure_point(args, "sd3-tiny-built", B, cfg, "lora", "none")
    assert "error" not in row, row.get("error")
    return bench_gpu, row


def test_a_built_model_runs_one_point_end_to_end_on_cpu(monkeypatch):
    """The path a real-shape build takes on the GPU, with the tiny SD3 in its place: a models.BUILT name, loaded by the
    trainer through load_pipeline, one warm-up and one timed epoch, FLOPs counted on its meta build, the rows of the
    epoch's calls, one table row."""
    bench_gpu, row = tiny_sd3_point(monkeypatch, num_steps=3, B=4, cfg=True)
    tr = row["trainer"]
    assert tr["samples"] == 4 and tr["sampling_rows"] == 1 * 3 * 4 * 2  # batches x steps x B, CFG doubled
    # 2 of the 3 steps per sample: the last one's std (0.006) is under train.min_step_std (0.02); CFG trained: x 2
    assert tr["train_sample_steps"] == 4 * 2 and tr["train_rows"] == 2 * 4 * 2
    assert row["denoiser_params"] == sum(p.numel() for p in build_sd3_tiny().components["transformer"].parameters())
    assert row["flops_train_row"] > 2 * row["flops_fwd_row"] > 0 and row["peak_mem_mb"] is None
    assert row["mfu_sampling"] == pytest.approx(row["flops_fwd_row"] * 24 / (tr["samples"] / row["samples_per_s"])
                                                / 989e12)
    # the calls counted on the denoiser (issue 61: MFU's rows are the calls the phase ran): sampling's 24 rows; the
    # update's 16 with autograd; the rescore's forwards of the same 16 rows when the epoch re-scored (train.old_logprobs
    # 'auto' decides per epoch); policy_shift_kl's forward of the first call (4 samples x 1 step x CFG 2) without
    rows = tr["rows"]
    assert rows["sampling"] == 24 and rows["train_grad"] == 16 and rows["train_nograd"] == 8
    assert rows.get("rescore", 0) == 16 * tr["rescore_calls"] and tr["rescore_s"] >= 0
    assert [set(e) for e in tr["epochs_s"]] == [{"sampling_s", "training_s", "epoch_s", "rescore_s", "data_s",
                                                 "reward_wait_s"}] * 2
    # the sampling phase's non-denoiser parts: the condition reads (the tiny SD3's prompts: ~0) and the reward wait
    assert 0 <= tr["data_s"] < tr["sampling_s"] and 0 <= tr["reward_wait_s"] < tr["sampling_s"]
    # training MFU: every training-phase call's FLOPs over the whole training phase; the update alone over it less
    # the rescore's seconds
    fwd, train = row["flops_fwd_row"], row["flops_train_row"]
    assert row["mfu_training"] == pytest.approx((16 * train + (8 + rows.get("rescore", 0)) * fwd)
                                                / tr["training_s"] / 989e12)
    assert row["mfu_update"] == pytest.approx((16 * train + 8 * fwd) / (tr["training_s"] - tr["rescore_s"]) / 989e12)
    assert bench_gpu.table([row]).splitlines()[2].startswith("| sd3-tiny-built | lora | 4 | on | none | native |")


def test_a_built_model_point_reports_startup_and_onpolicy(monkeypatch):
    """The fields gpu_check.sh's table reads, from the real trainer on the tiny SD3 (float32 on CPU): the start-up
    phases (build_context's and the first denoiser call's), the worst |r - 1| of train_epoch's metrics within the
    float32 tolerance, and the sampler gap as train_epoch reports it (None where it does not)."""
    from ddpo_grpo.core.loss import onpolicy_tolerance

    _, row = tiny_sd3_point(monkeypatch, num_steps=2, B=2, cfg=False)
    st = row["startup"]
    assert {"load_s", "move_s", "embeddings_s", "first_step_s", "total_s"} <= set(st)
    assert min(st["load_s"], st["move_s"], st["embeddings_s"], st["first_step_s"]) >= 0
    # the four phases are disjoint parts of the whole (build_context's start to the first denoiser call's end)
    assert st["total_s"] == pytest.approx(st["load_s"] + st["move_s"] + st["embeddings_s"] + st["first_step_s"],
                                          abs=1e-3)
    assert st["embedding_prompts"] >= 2  # the CFG negative "" and at least one of the batch's prompts
    tol = onpolicy_tolerance(torch.float32, 1e-4)
    assert row["onpolicy_tol"] == tol
    assert row["onpolicy_ratio_max_dev"] is not None and 0 <= row["onpolicy_ratio_max_dev"] <= tol
    epochs = row["trainer"]["metrics"]
    assert len(epochs) == 2 and all("onpolicy_ratio_max_dev" in e for e in epochs)
    assert row["onpolicy_ratio_max_dev"] == max(e["onpolicy_ratio_max_dev"] for e in epochs)
    assert row["sampler_gap_max"] == max((e["sampler_gap_max"] for e in epochs if "sampler_gap_max" in e),
                                         default=None)


def test_points_are_appended_as_measured(tmp_path, monkeypatch):
    """bench_gpu.jsonl gets each point's row as soon as it is measured: a run that dies on its second point (killed
    by gpu_check.sh's time-out, here an exception) keeps the first row."""
    bench_gpu = load_bench()
    calls = []

    def fake(args, model, B, cfg, mode, switch):
        calls.append(B)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a SIGINT / a kill would: nothing after this point runs
        return {"model": model, "batch_size": B, "cfg": cfg, "mode": mode, "switch": switch, "epoch_s": 1.5}

    monkeypatch.setattr(bench_gpu, "measure_point", fake)
    with pytest.raises(KeyboardInterrupt):
        bench_gpu.main(["--allow-cpu", "--resolution", "64", "--batch-sizes", "2,4", "--cfg", "off", "--modes", "lora",
                        "--out", str(tmp_path)])
    lines = (tmp_path / "bench_gpu.jsonl").read_text().splitlines()
    assert len(lines) == 1 and calls == [2, 4]
    row = __import__("json").loads(lines[0])
    assert row["batch_size"] == 2 and row["epoch_s"] == 1.5 and "torch" in row and "date" in row


def test_check_table_reads_rows_counts_and_fails_on_missing_error_or_off_policy(tmp_path, capsys):
    """gpu_check.sh's table: one line per expected build; MFU and the plan from the counts file; '-' for a metric the
    trainer did not report; exit 1 naming the builds with no row, an error row or |r - 1| over its tolerance."""
    import json

    bench_gpu = load_bench()
    trainer = {"sampling_s": 2.0, "training_s": 4.0, "sampling_rows": 100, "train_rows": 50, "reference_rows": 0}
    good = {"model": "sd15-random", "batch_size": 8, "num_steps": 10, "epoch_s": 6.0, "samples_per_s": 4.0,
            "train_steps_per_s": 20.0, "peak_mem_mb": 9.5 * 1024, "onpolicy_ratio_max_dev": 0.0, "onpolicy_tol": 5e-5,
            "sampler_gap_max": 1.5e-3, "startup": {"total_s": 12.0, "load_s": 3.0, "move_s": 1.0, "embeddings_s": 0.5,
                                                   "first_step_s": 7.0}, "trainer": trainer,
            "gpu": "H100", "torch": "2.11", "date": "2026-11-27"}
    off = dict(good, model="sdxl-random", onpolicy_ratio_max_dev=1.4e-3)
    rows = [good, off, {"model": "flux-dev-random", "error": "timed out after 105 s"}]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "c.json").write_text(json.dumps({"sd15-random": {"plan_gib": 9.2, "flops_fwd_row": 1e12,
                                                                 "flops_train_row": 2e12}}))
    args = bench_gpu.parse(["--table", str(tmp_path / "r.jsonl"), "--counts", str(tmp_path / "c.json"),
                            "--expect", "sd15-random,sdxl-random,wan21-1.3b-random,flux-dev-random"])
    assert bench_gpu.print_check_table(args) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "H100, torch 2.11, 2026-11-27"
    assert len(out[1].split(" | ")) == len(out[2].split("|")) - 2 == 13  # the header's cells, the separator's
    sd15, sdxl, wan, flux = out[3:7]
    # MFU from the config's rows (a row without counted calls): 1e12 x 100 rows / 2 s / 989e12 = 0.051 sampling;
    # 2e12 x 50 / 4 s / 989e12 = 0.025 training
    assert sd15 == ("| sd15-random | 8 x 10 | 12.0 (3.0 / 1.0 / 0.5 / 7.0) | - / 6.0 | 2.0 (- / -) | 4.0 (- / -) | - | "
                    "4.00 | 0.051 / 0.025 | 9.5 / - / 9.2 | 0.0e+00 (5e-05) | 1.5e-03 / - | ok |")
    assert "1.4e-03 (5e-05) OVER" in sdxl and "| - / - |" in sdxl and sdxl.endswith("| OVER tolerance |")
    assert wan.startswith("| wan21-1.3b-random | - x - |") and "| FAILED (no row): no row" in wan
    assert flux.endswith("| FAILED (error): timed out after 105 s |")  # an older shell's row: no cause, no traceback
    assert out[-1] == ("gpu check: 3 of 4 builds failed or off-policy: sdxl-random, wan21-1.3b-random, "
                       "flux-dev-random")
    args = bench_gpu.parse(["--table", str(tmp_path / "r.jsonl"), "--expect", "sd15-random"])
    assert bench_gpu.print_check_table(args) == 0


def gpu_check(*args, out):
    import subprocess

    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=dict(ENV, OUT=str(out), **python_for_shell(ENV)))


def test_gpu_check_refuses_in_one_line(tmp_path):
    p = gpu_check("--fast", out=tmp_path)
    assert p.returncode == 2 and p.stderr.strip() == ("error: unknown argument '--fast'; usage: scripts/gpu_check.sh "
                                                      "[--dry-run | --simulate] [--only NAME[,NAME...]]")
    p = gpu_check("--only", "sd15", out=tmp_path)
    assert p.returncode == 2 and p.stderr.strip() == (
        "error: --only sd15: not a build; choose from sd15-random,sd35-medium-random,sdxl-random,wan21-1.3b-random,"
        "recam-1.3b-random,flux-dev-random")
    p = gpu_check(out=tmp_path)  # CUDA hidden: the GPU run is refused before any model is built
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1] == "error: no CUDA device; on a CPU run scripts/gpu_check.sh --dry-run"
    assert not (tmp_path / "bench_gpu.jsonl").exists()


def test_gpu_check_dry_run_validates_all_six(dry_run):
    """scripts/gpu_check.sh --dry-run on a CPU: every build's gpu check config validated, its memory plan made (fits
    80 GB, gradient checkpointing exactly where the plan needs it) and its denoiser counted on "meta" (the real
    parameter counts), written to $OUT/counts.json."""
    bench_gpu = load_bench()
    p, _ = dry_run
    counts = dry_counts(dry_run)
    assert p.stdout.strip().splitlines()[-1] == "gpu check dry run: all six builds validated"
    assert list(counts) == list(bench_gpu.GPU_CHECK) and set(counts) == set(bench_gpu.MODELS)
    assert sum(t for t, *_ in bench_gpu.GPU_CHECK.values()) <= 450  # the 8 minutes, with the host's start-up
    for model, c in counts.items():
        assert 0 < c["plan_gib"] <= bench_gpu.GPU_CHECK_MEMORY_GIB
        assert c["gradient_checkpointing"] == bench_gpu.GPU_CHECK[model][3]
        assert c["flops_train_row"] > 2 * c["flops_fwd_row"] > 0
        if model in REAL:
            assert c["denoiser_params"] == REAL[model][0]
        assert f"{model}: memory plan {c['plan_gib']:.2f} GiB (fits 80)" in p.stdout


def test_condition_shape_is_encoded_once_per_set_of_encoders_and_tokenizers():
    """meta_counts.condition_shape reads pipe.encode once for the same text encoders and tokenizers, and again for a
    pipe that shares the first encoder but has another tokenizer (its shape may differ: max_sequence_length)."""
    import types

    from ddpo_grpo.trainer.checks.meta_counts import condition_shape

    encoder = torch.nn.Linear(2, 2)
    calls = []

    def make(tokenizer, length):
        def encode(prompts):
            calls.append(length)
            return torch.zeros(len(prompts), length, 8)

        return types.SimpleNamespace(adapter=types.SimpleNamespace(name="sd3"), components={"tokenizer": tokenizer},
                                     tokenizer=tokenizer, text_encoders=lambda: [encoder], encode=encode)

    first, other = object(), object()
    a = make(first, 77)
    assert condition_shape(a) == condition_shape(a) == (77, 8) and calls == [77]
    assert condition_shape(make(first, 77)) == (77, 8) and calls == [77]  # another pipe over the same parts
    assert condition_shape(make(other, 333)) == (333, 8) and calls == [77, 333]
    assert condition_shape(a) == (77, 8) and calls == [77, 333, 77]  # the memo holds one entry per first encoder
