"""Regenerate tests/golden/configs/NAME.json for every named config of config/grpo.py (deliberately: after a change
of a default or of a named config that is meant; name the change in the commit). Run from anywhere:

    python tests/golden/update.py            # all named configs
    python tests/golden/update.py tiny recam # only these
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # ddpo_grpo, config

from golden_configs import FOLDER, grpo_module, write  # noqa: E402


def main(names):
    mod = grpo_module()
    known = sorted(mod.CONFIGS)  # config/grpo.py's index
    names = names or known
    unknown = sorted(set(names) - set(known))
    if unknown:
        print(f"error: unknown config names {unknown}; named configs: {', '.join(known)}", file=sys.stderr)
        return 2
    os.makedirs(FOLDER, exist_ok=True)
    if not sys.argv[1:]:  # a full update also drops the files of configs that no longer exist
        for f in os.listdir(FOLDER):
            if f.endswith(".json") and f[:-5] not in known:
                os.remove(os.path.join(FOLDER, f))
    for name in names:
        print(write(name))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
