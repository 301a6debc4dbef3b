"""scripts/train.py with accelerate's FSDP2 kept on CPU processes (gloo); for tests/test_scale_out.py only:
    accelerate launch --config_file config/accelerate/fsdp2.yaml ... tests/fsdp_cpu_train.py --config ...
accelerate 1.15 would otherwise run an FSDP launch on CPU as plain DDP (see ddpo_grpo/trainer/scale.py)."""
import os
import runpy
import sys

from ddpo_grpo.trainer.scale import enable_fsdp_on_cpu

if __name__ == "__main__":
    enable_fsdp_on_cpu()
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "train.py")
    sys.argv[0] = script
    runpy.run_path(script, run_name="__main__")
