"""train.ema_decay on the trainer's own context (tiny, full fine-tuning): eval measures the EMA's weights, and
eval.also_policy the trained policy's, each what the same eval of those weights put in the policy gives; the policy
is left bit for bit as it was; the optimizer step mixes the EMA."""
import numpy as np
import pytest
import torch


@pytest.mark.timeout(300)
def test_eval_measures_the_ema_and_also_policy_the_trained_weights(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from config.grpo import get_config

    from ddpo_grpo.trainer.epoch.evaluation import evaluate
    from ddpo_grpo.trainer.epoch.metrics import EpochMetrics
    from ddpo_grpo.trainer.epoch.update import optimizer_step
    from ddpo_grpo.trainer.run.build import build_context
    from ddpo_grpo.trainer.run.reporting import evaluate_and_log

    config = get_config("tiny")
    config.logging.wandb = config.logging.tensorboard = False
    config.mixed_precision, config.use_lora = "no", False
    config.train.ema_decay, config.eval.also_policy = 0.9, True
    config.eval.num_samples, config.eval.batch_size, config.eval.pass_at_k = 8, 8, 0
    config.sample.num_steps = 4
    AcceleratorState._reset_state(reset_partial_state=True)
    ctx = build_context(config, Accelerator(cpu=True, mixed_precision="no"), str(tmp_path))
    try:
        unet = ctx.accelerator.unwrap_model(ctx.unet)
        params = [p for p in unet.parameters() if p.requires_grad]
        start = {n: p.detach().clone() for n, p in unet.named_parameters() if p.requires_grad}
        g = torch.Generator().manual_seed(0)
        after = []
        for _ in range(3):  # three "updates": a random gradient, one optimizer step each (which mixes the EMA)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            optimizer_step(ctx, params, EpochMetrics())
            after.append({n: p.detach().clone() for n, p in unet.named_parameters() if p.requires_grad})
        assert ctx.ema.num_updates == 3
        trained = after[-1]
        assert any(not torch.equal(trained[n], start[n]) for n in trained)
        for n, t in ctx.ema.tensors.items():  # by hand: a copy at the first mix, then old weights 2/11 and 3/12
            want = (after[0][n] * 2 / 11 + after[1][n] * 9 / 11) * 0.25 + after[2][n] * 0.75
            torch.testing.assert_close(t, want, rtol=1e-5, atol=1e-6)
        ema_w = {n: t.clone() for n, t in ctx.ema.tensors.items()}
        got_ema, img_ema, _ = evaluate(ctx)
        got_policy, img_policy, _ = evaluate(ctx, policy=True)
        for n, p in unet.named_parameters():  # restored bit for bit after each
            if p.requires_grad:
                assert torch.equal(p.detach(), trained[n])
        assert (img_ema - img_policy).abs().max() > 1e-3  # the two weights sample different images
        logged = evaluate_and_log(ctx, 1)  # the trainer's eval step: both, the EMA's under eval/
        for k, v in got_ema.items():
            assert logged[k] == pytest.approx(v, rel=1e-6) and logged["eval_policy/" + k[5:]] == pytest.approx(
                got_policy[k], rel=1e-6)
        with torch.no_grad():  # the EMA's weights put in the policy, evaluated as the policy: eval's images and numbers
            for n, p in unet.named_parameters():
                if p.requires_grad:
                    p.copy_(ema_w[n])
        again, img_again, _ = evaluate(ctx, policy=True)
        torch.testing.assert_close(img_again, img_ema, rtol=1e-5, atol=1e-6)
        assert again.keys() == got_ema.keys()
        np.testing.assert_allclose([again[k] for k in again], [got_ema[k] for k in again], rtol=1e-5, atol=1e-6)
    finally:
        ctx.rewards.shutdown()
        AcceleratorState._reset_state(reset_partial_state=True)
