"""Small models for tests: built in memory, random weights, seeded."""
import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler, UNet2DConditionModel


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
