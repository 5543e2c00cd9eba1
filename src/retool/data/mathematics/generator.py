"""The DeepMind Mathematics generator driver: run by the generator's own interpreter, never imported by retool.

``python generator.py --out FILE --split SPLIT --per-module N --seed S [--modules a,b]`` writes one JSON line per
question (``module``, ``split``, ``question``, ``answer``) produced by the official ``mathematics_dataset``
package (Saxton et al. 2019, Apache-2.0), unchanged: its module tables (``modules.train`` / ``test`` /
``test_extra``) and its own ``generate.sample_from_module`` (which drops over-long questions and answers as
the published dataset does). Only the random state is ours: each (split, module) is seeded from
``sha256(seed/split/module)`` for ``random`` and ``numpy.random``, so a module's rows do not depend on which
other modules were asked for or in what order.

This file imports nothing from retool and only the standard library besides the generator: the generator needs
``sympy==1.5.1`` (it imports names sympy 1.6 moved), so it runs in an environment of its own
(``scripts/setup_mathematics.sh``), and retool talks to it through this script's JSONL output.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys

SPLITS = ("train", "interpolate", "extrapolate")


def module_seed(seed: int, split: str, module: str) -> int:
    digest = hashlib.sha256(f"{seed}/{split}/{module}".encode()).hexdigest()
    return int(digest[:8], 16)


def module_table(split: str) -> dict[str, object]:
    """The generator's flat ``{name: sampler}`` table of ``split``, names as the dataset spells them."""
    # deferred: the generator imports sympy and numpy, which --help and argument errors do not need
    from mathematics_dataset import generate
    from mathematics_dataset.modules import modules

    if split == "train":
        nested = modules.train(generate._make_entropy_fn(0, 1))
    elif split == "interpolate":
        nested = modules.test()
    else:
        nested = modules.test_extra()
    flat: dict[str, object] = {}

    def add(table: dict[str, object], prefix: str | None) -> None:
        for key, value in table.items():
            name = f"{prefix}__{key}" if prefix else key
            if isinstance(value, dict):
                add(value, name)
            else:
                flat[name] = value

    add(nested, None)
    return dict(sorted(flat.items()))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--split", choices=SPLITS, required=True)
    parser.add_argument("--per-module", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modules", default="", help="comma-separated module names (default: all)")
    parser.add_argument("--list", action="store_true", help="print the split's module names and exit")
    args = parser.parse_args(argv)

    # deferred: as in module_table (an argument error answers before the generator loads)
    import numpy as np
    from absl import flags
    from mathematics_dataset import generate

    flags.FLAGS.mark_as_parsed()  # sample_from_module reads FLAGS.show_dropped (default False)
    table = module_table(args.split)
    if args.list:
        print("\n".join(table))
        return 0
    wanted = [m for m in args.modules.split(",") if m] or list(table)
    unknown = [m for m in wanted if m not in table]
    if unknown:
        print(f"unknown {args.split} modules: {', '.join(unknown)}", file=sys.stderr)
        return 2
    with open(args.out, "w", encoding="utf-8") as fh:
        for name in wanted:
            seed = module_seed(args.seed, args.split, name)
            random.seed(seed)
            np.random.seed(seed)
            dropped = 0
            for _ in range(args.per_module):
                problem, extra = generate.sample_from_module(table[name])
                dropped += extra
                row = {
                    "module": name,
                    "split": args.split,
                    "question": str(problem.question),
                    "answer": str(problem.answer),
                }
                fh.write(json.dumps(row) + "\n")
            fh.write(
                json.dumps({"module": name, "split": args.split, "dropped": dropped, "seed": seed}) + "\n"
            )
            fh.flush()
            print(f"{args.split}/{name}: {args.per_module}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
