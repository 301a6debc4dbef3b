"""benchmarks/readme_tables.py: the README's demo table and suite line come from the runs' JSON (hand numbers)."""
import json
import os
import subprocess
import sys

from helpers import ROOT

sys.path.insert(0, ROOT)
from benchmarks.readme_tables import DEMO, demo_block, replace, suite_block  # noqa: E402


def _evals(strict, colour):
    return {"eval/toyworld/strict_accuracy": strict, "eval/toyworld/color_accuracy": colour,
            "eval/toyworld/shape_accuracy": 0.9, "eval/toyworld/position_accuracy": 1.0,
            "eval/pass_at_4": 0.875, "eval/pass_at_1_stochastic": 0.5}


def test_demo_block_from_a_summary(tmp_path):
    history = [dict(epoch=0, eval_reward_mean=0.7, **_evals(0.32, 0.367)), dict(epoch=1, reward_mean=0.8)]
    json.dump({"seconds": 675.4, "history": history, "final_eval": _evals(0.742, 0.78125)},
              open(tmp_path / "summary.json", "w"))
    block = demo_block(str(tmp_path)).splitlines()
    assert block[0].endswith("| epoch 0 | 2 |")  # the final eval is after the last epoch (1): column 2
    assert block[2] == "| strict accuracy (all three attributes right) | 0.320 | **0.742** |"
    assert block[3] == "| colour / shape / position accuracy | .367 / .900 / 1.00 | **.781** / .900 / 1.00 |"
    assert block[4] == "| pass@4 / stochastic pass@1 | .875 / .500 | .875 / **.500** |"
    assert block[-1].startswith("Wall time 11 min 15 s")


def test_suite_line_and_markers(tmp_path):
    p = tmp_path / "suite.json"
    p.write_text(json.dumps({"passed": 700, "skipped": 6, "seconds": 725, "commit": "abc1234", "date": "2026-11-27"}))
    assert suite_block(str(p)) == "700 passed, 6 skipped in 12 min 5 s (fresh clone at abc1234, 2026-11-27)"
    probed = tmp_path / "probed.json"  # benchmarks/cpu_speed.py's seconds before / after (null: the probe failed)
    probed.write_text(json.dumps({"passed": 9, "skipped": 0, "seconds": 61, "commit": "c", "date": "d",
                                  "cpu_speed_s": [2.46, None]}))
    assert suite_block(str(probed)) == "9 passed, 0 skipped in 1 min 1 s (fresh clone at c, d; CPU probe 2.5 s)"
    probed.write_text(json.dumps({"passed": 9, "skipped": 0, "seconds": 61, "commit": "c", "date": "d",
                                  "cpu_speed_s": [2.46, 3.04]}))
    assert suite_block(str(probed)).endswith("(fresh clone at c, d; CPU probe 2.5 / 3.0 s)")
    text = f"a\n{DEMO[0]}\nold\n{DEMO[1]}\nb"
    assert replace(text, DEMO, "new") == f"a\n{DEMO[0]}\nnew\n{DEMO[1]}\nb"
    readme = tmp_path / "README.md"
    readme.write_text("no markers here")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "readme_tables.py"), "--suite", str(p),
                        "--write", str(readme)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == "error: README has no <!-- suite --> ... <!-- /suite --> block"


def test_cpu_probe_prints_the_json_suite_time_reads(monkeypatch, capsys):
    """benchmarks/cpu_speed.py's one line is JSON whose "seconds" (what suite_time.sh writes to cpu_speed_s) is the
    median of its timed repeats, after one untimed warm-up. (Its workload swapped for a counter: the probe's own
    seconds are not the suite's to spend.)"""
    import types

    from benchmarks import cpu_speed

    calls = []
    clock = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])  # repeats of 1 s, 3 s and 2 s
    monkeypatch.setattr(cpu_speed, "workload", lambda: calls.append(1))
    monkeypatch.setattr(cpu_speed, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    cpu_speed.main(["--repeats", "3"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out == {"seconds": 2.0, "repeats": [1.0, 3.0, 2.0]} and len(calls) == 4
