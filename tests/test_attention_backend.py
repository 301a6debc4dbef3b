"""config.attention_backend (core/attention.py): validated in one line before anything loads, which SDPA kernels each
value allows per device, and, where CUDA is, each kernel's forward + backward at FLUX's attention shapes (the
real-shape FLUX training phase hit an illegal memory access on an H100 with torch 2.11: issue 50)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from ddpo_grpo.core.attention import ATTENTION_BACKENDS, allowed, apply_attention_backend, check_attention_backend
from ddpo_grpo.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_bad_attention_backend_is_one_line_exit_2(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "scripts/train.py", "--config", "config/grpo.py:tiny",
                        f"--config.logdir={tmp_path}", "--config.attention_backend=fast"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == ("error: attention_backend='fast'; choose one of auto, flash, "
                                                 "efficient, cudnn, math")
    assert not any("startup:" in line for line in p.stdout.splitlines())  # refused before anything loaded


def test_validation_and_the_kernels_each_value_allows():
    import ml_collections

    for name in ATTENTION_BACKENDS:
        assert check_attention_backend(ml_collections.ConfigDict({"attention_backend": name})) == name
    assert check_attention_backend(ml_collections.ConfigDict({})) == "auto"  # a hand-built config without it
    with pytest.raises(ConfigError, match=r"^attention_backend='cuDNN'; choose one of auto, flash"):
        check_attention_backend(ml_collections.ConfigDict({"attention_backend": "cuDNN"}))
    assert allowed("auto", "cuda") == ["flash", "efficient", "math"]  # never cuDNN attention on CUDA
    assert allowed("auto", "cpu") is None and allowed("auto", "npu") is None  # torch's own choice there
    assert allowed("cudnn", "cuda") == ["cudnn"] and allowed("math", "cpu") == ["math"]
    with pytest.raises(ConfigError, match=r"^attention_backend='flash' is a CUDA kernel and this run is on cpu"):
        allowed("flash", "cpu")


def test_auto_on_cpu_leaves_torchs_switches_alone():
    flags = [torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
             torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()]
    assert apply_attention_backend("auto", "cpu") == "attention: auto: torch's default SDPA kernel choice on cpu"
    assert [torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()] == flags


# One backend per process: an illegal memory access leaves the CUDA context unusable, so it must not take the other
# backends' cases (or the rest of the suite) with it. Forward + backward at FLUX.1-dev's joint attention: 24 heads of
# 128, 512 text tokens + 1024 image tokens (512 px, the flux config) or 4096 (1024 px), batch 2, bf16; compared with
# the math kernel computed in float32 from the same inputs.
CASE = r"""
import json, sys, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
backend = getattr(SDPBackend, sys.argv[1])
out = {}
for image_tokens in (1024, 4096):
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, 24, 512 + image_tokens, 128)
    q, k, v, d = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    ref = [t.float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        r = F.scaled_dot_product_attention(*ref)
        r.backward(d.float())
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(backend):
        o = F.scaled_dot_product_attention(*ins)
        o.backward(d)
    torch.cuda.synchronize()
    err = lambda a, b: float((a.float() - b).abs().max() / b.abs().max())
    out[image_tokens] = {"out": err(o, r), "dq": err(ins[0].grad, ref[0].grad), "dk": err(ins[1].grad, ref[1].grad),
                         "dv": err(ins[2].grad, ref[2].grad),
                         "finite": all(bool(t.isfinite().all()) for t in (o, *(x.grad for x in ins)))}
print(json.dumps(out))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the kernels under test are CUDA's")
@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "CUDNN_ATTENTION"])
def test_flux_shaped_attention_forward_and_backward_per_backend(backend):
    p = subprocess.run([sys.executable, "-c", CASE, backend], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1"))  # an error names the kernel that made it
    problem = (p.returncode != 0 and f"exit {p.returncode}: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    if not problem:
        for tokens, r in json.loads(p.stdout.strip().splitlines()[-1]).items():
            # bf16 inputs against the float32 reference: relative to the largest value, a few bf16 ulps (2^-8)
            if not r["finite"] or max(r["out"], r["dq"], r["dk"], r["dv"]) >= 2e-2:
                problem = f"512 + {tokens} tokens: {r}"
    if backend == "CUDNN_ATTENTION" and problem:
        # what attention_backend="auto" avoids on CUDA: recorded (pytest -rx shows it), not a failure of this library
        pytest.xfail(f"cuDNN attention at FLUX shapes: {problem}")
    assert not problem, (backend, problem, p.stderr[-3000:])
