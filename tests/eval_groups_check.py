"""eval.group_by on the trainer's own context, in however many processes this is launched with (tests/test_eval_groups.py):
every process evaluates its shard, and the per-group means must be the gathered per-sample rewards grouped by the
prompt of the sample's eval position (eval_positions, rank-major), with the counts eval_positions gives. Prints
"groups ok N" on the main process, or fails an assert."""
import json
import sys
from collections import Counter

import numpy as np


def main(logdir: str) -> None:
    from accelerate import Accelerator
    from config.grpo import get_config

    from ddpo_grpo.trainer.epoch.evaluation import eval_positions, evaluate, group_value
    from ddpo_grpo.trainer.run.build import build_context

    config = get_config("tiny")
    config.logging.wandb = config.logging.tensorboard = False
    config.eval.num_samples, config.eval.batch_size, config.eval.pass_at_k = 10, 3, 0  # shards of 5 (2 processes)
    config.eval.group_by = "prompt"
    acc = Accelerator(cpu=True, mixed_precision="no")
    ctx = build_context(config, acc, logdir)
    try:
        per_sample = {}
        metrics, _, _ = evaluate(ctx, per_sample)
        proxy = per_sample["proxy"]
        n = len(proxy)
        pos = eval_positions(len(ctx.eval_data), config.eval.num_samples, config.eval.seed)[:n]
        names = [group_value(ctx.eval_data[int(p)], "prompt") for p in pos]
        counts = Counter(names)
        assert len(counts) >= 3, counts  # several groups, so a misaligned gather would show
        got = {k[len("eval/by_prompt/"):]: v for k, v in metrics.items() if k.startswith("eval/by_prompt/")}
        assert set(got) == set(counts) | {f"{g}/n" for g in counts}, sorted(got)
        for g, c in counts.items():
            assert got[f"{g}/n"] == c, (g, got[f"{g}/n"], c)
            want = float(np.mean([s for s, name in zip(proxy, names) if name == g]))
            assert abs(got[g] - want) < 1e-6, (g, got[g], want)
        assert len(set(np.round(proxy, 6))) >= 2, proxy  # the rewards differ, so the grouping is tested
        if acc.is_main_process:
            print("groups ok", n, json.dumps(dict(counts)), flush=True)
    finally:
        ctx.rewards.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
