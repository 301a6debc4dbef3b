"""Optional supervised auxiliary loss (seed 003's staged warm-up): the pretraining denoising loss on the
toy world's data, added to the GRPO loss to hold the model near its data while the reward pulls.

Weight schedule over epochs: linear ramp up over sup_warmup_epochs, then constant sup_weight, or a
linear decay to 0 over sup_decay_epochs when that is > 0.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ddpo_grpo.errors import ConfigError
from ddpo_grpo.core.families import get_family


def sup_weight(config, epoch: int) -> float:
    t = config.train
    w = t.sup_weight
    if t.sup_warmup_epochs > 0 and epoch < t.sup_warmup_epochs:
        return w * (epoch + 1) / t.sup_warmup_epochs
    if t.sup_decay_epochs > 0:
        return w * max(0.0, 1.0 - (epoch - t.sup_warmup_epochs) / t.sup_decay_epochs)
    return w


class SupervisedLoss:
    def __init__(self, config, pipe):
        if config.data.name != "toyworld":
            raise ConfigError("train.sup_weight > 0 needs pretraining data; it is available for data.name='toyworld'")
        self.config, self.pipe = config, pipe
        self.family = get_family(pipe.family)  # the pretraining target: epsilon / v / x0 (DDIM), velocity (flow)
        self.rng = np.random.default_rng((config.seed, 17))

    def loss(self, unet, epoch: int) -> Optional[Tuple[torch.Tensor, float]]:
        """(weighted loss, raw loss) on a fresh batch of renders, or None when the weight is 0 this epoch."""
        from ddpo_grpo.worlds.toyworld import sample_training_batch

        w = sup_weight(self.config, epoch)
        if w <= 0:
            return None
        prompts, x0, _ = sample_training_batch(self.config.train.sup_batch_size, self.rng)
        device = next(unet.parameters()).device
        x0 = x0.to(device)
        with torch.no_grad():
            emb = self.pipe.encode(prompts)
        noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(int(self.rng.integers(2**62)))).to(device)
        u = torch.rand(x0.shape[0], device=device)
        xt, t, target = self.family.noised_and_target(self.pipe.scheduler, x0, noise, u)
        raw = F.mse_loss(unet(xt, t, encoder_hidden_states=emb).sample.float(), target.float())
        return w * raw, float(raw)
