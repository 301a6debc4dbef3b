"""scripts/train.py with accelerate's FSDP2 kept on CPU processes (gloo); for tests/test_scale_out.py only:
    accelerate launch --config_file config/accelerate/fsdp2.yaml ... tests/fsdp_cpu_train.py --config ...
accelerate 1.15 runs FSDP on GPU-like process groups only; on CPU the trainer refuses an FSDP launch in one line
(ddpo_grpo/trainer/run/scale.py check_engine_applied). This test-only patch of accelerate's internals makes it keep the
FSDP plugin on CPU processes, so that torch's fully_shard really shards the model over gloo and the trainer's FSDP2
path (which then passes that check) is exercised here. It lives in tests/: the library never patches accelerate."""
import os
import runpy
import sys


def enable_fsdp_on_cpu() -> None:
    """Make accelerate keep an FSDP plugin on CPU processes (gloo) instead of running DDP. Call before the
    Accelerator is built; the launch must be an FSDP one (ACCELERATE_USE_FSDP=true)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, "_fsdp_on_cpu", False):
        return

    def init(self, mixed_precision=None, cpu=False, dynamo_plugin=None, deepspeed_plugin=None, fsdp_plugin=None,
             *args, **kwargs):
        original(self, mixed_precision, cpu, dynamo_plugin, deepspeed_plugin, fsdp_plugin, *args, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = self.distributed_type  # as accelerate does on GPU

    init._fsdp_on_cpu = True
    AcceleratorState.__init__ = init


if __name__ == "__main__":
    enable_fsdp_on_cpu()
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "train.py")
    sys.argv[0] = script
    runpy.run_path(script, run_name="__main__")
