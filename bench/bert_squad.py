"""The main job against plain Keras: `python -m model_zoo.bert_squad` with EPLTrainer (its
default layout on 2 simulated devices: a 2-stage pipeline with 4 micro-batches, or data
parallelism where oneDNN is off, `recipe.default_num_stages`) and with `--trainer=keras`
(the same model, data, optimizer and steps with Keras `fit` on one device).

Usage: python bench/bert_squad.py [--seeds 0 1 2] [--trainer epl keras] [-- EXTRA FLAGS]
       python bench/bert_squad.py --speed [--repeats 2]
       python bench/bert_squad.py --against COMMIT [--seeds 0 1 2]

Each run is a fresh process, one at a time (2 cores). Prints dev EM / F1 and the wall
time of every run, then one row per trainer with the mean over seeds and the F1
difference to plain Keras. The engine must lose nothing: the same seed gives the same
initial weights and batches, so the F1 of the two trainers should agree.

`--speed` runs the EPL default (XLA-compiled updates, 16 steps per call, stages as plain
ops with one thread per op per simulated device) against the engine without XLA and
with one step per call (`--steps_per_execution=1`, `optimizer.jit_compile=False`), with
XLA-compiled stages (`--jit_compile`) and with TensorFlow's thread pools
(`cluster.intra_op_threads=2`), seed 0, interleaved, and prints the wall and training
times.

`--against COMMIT` runs EPLTrainer here and at COMMIT (a temporary git worktree, whose
own `model_zoo` and `epl_trainer` it imports), each seed's two runs back to back with
the first of them alternating, and prints the speedup per seed. Wall times on this
machine drift by up to 2x over minutes, so only runs made side by side compare.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)


def run(trainer: str, seed: int, extra: list[str], root: str = ROOT) -> dict:
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            "-m",
            "model_zoo.bert_squad",
            f"--trainer={trainer}",
            f"--seed={seed}",
            f"--output_dir={out}",
            *extra,
        ]
        env = {**os.environ, "PYTHONPATH": os.path.abspath(root)}
        subprocess.run(command, cwd=root, env=env, check=True, capture_output=True, text=True)
        with open(os.path.join(out, "metrics.json")) as f:
            metrics = json.load(f)
    return {
        "trainer": trainer,
        "seed": seed,
        "em": metrics["dev"]["exact_match"],
        "f1": metrics["dev"]["f1"],
        "seconds": metrics["wall_time_sec"],
        # Without data preparation and dev predictions (older commits do not write it).
        "train_s": metrics.get("seconds", {}).get("training", float("nan")),
    }


SPEED_VARIANTS = {
    "no XLA, 1 step per call": [
        "--steps_per_execution=1",
        "--epl_set=optimizer.jit_compile=False",
    ],
    "default": [],
    "default with XLA stages": ["--jit_compile"],
    "default with TF's thread pools": ["--epl_set=cluster.intra_op_threads=2"],
}


def speed(repeats: int, extra: list[str]) -> None:
    print(f"{'variant':<26} {'EM':>6} {'F1':>6} {'wall s':>7} {'train s':>7}")
    times = {name: [] for name in SPEED_VARIANTS}
    for _ in range(repeats):
        for name, flags in SPEED_VARIANTS.items():
            row = run("epl", 0, [*flags, *extra])
            times[name].append(row["seconds"])
            print(
                f"{name:<26} {row['em']:6.1f} {row['f1']:6.1f} {row['seconds']:7.1f} "
                f"{row['train_s']:7.1f}"
            )
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["no XLA, 1 step per call"]
    print()
    for name, median in medians.items():
        print(f"median wall {name:<26} {median:7.1f} s ({base / median:.2f}x the first)")


def against(commit: str, seeds: list[int], extra: list[str]) -> None:
    """EPLTrainer here and at `commit`, side by side per seed (the module docstring)."""
    with tempfile.TemporaryDirectory() as parent:
        tree = os.path.join(parent, "tree")
        git = ["git", "-C", ROOT, "worktree"]
        subprocess.run([*git, "add", "--detach", tree, commit], check=True, capture_output=True)
        try:
            print(
                f"{'seed':>4}  {'here EM / F1':>13} {'wall s':>7}  {commit[:10] + ' EM / F1':>19} "
                f"{'wall s':>7}  speedup"
            )
            speedups = []
            for i, seed in enumerate(seeds):
                order = [("here", ROOT), ("then", tree)][:: -1 if i % 2 else 1]
                rows = {label: run("epl", seed, extra, root) for label, root in order}
                here, then = rows["here"], rows["then"]
                speedups.append(then["seconds"] / here["seconds"])
                print(
                    f"{seed:>4}  {here['em']:6.1f} / {here['f1']:5.1f} {here['seconds']:7.1f}  "
                    f"{then['em']:11.1f} / {then['f1']:5.1f} {then['seconds']:7.1f}  "
                    f"{speedups[-1]:6.2f}x"
                )
            print(f"mean speedup {statistics.mean(speedups):.2f}x, lowest {min(speedups):.2f}x")
        finally:
            subprocess.run([*git, "remove", "--force", tree], check=False, capture_output=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--trainer", nargs="+", default=["epl", "keras"])
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--against", metavar="COMMIT", help="EPLTrainer here vs at COMMIT")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.against:
        against(args.against, args.seeds, extra)
        return
    if args.speed:
        speed(args.repeats, extra)
        return
    rows = []
    print(f"{'trainer':<8} {'seed':>4} {'EM':>6} {'F1':>6} {'wall s':>7} {'train s':>7}")
    for seed in args.seeds:
        for trainer in args.trainer:
            row = run(trainer, seed, extra)
            rows.append(row)
            print(
                f"{trainer:<8} {seed:>4} {row['em']:6.1f} {row['f1']:6.1f} "
                f"{row['seconds']:7.1f} {row['train_s']:7.1f}"
            )
    print(
        f"\n{'trainer':<8} {'mean EM':>8} {'mean F1':>8} {'min F1':>7} {'mean s':>7}  F1 vs keras"
    )
    keras_f1 = {r["seed"]: r["f1"] for r in rows if r["trainer"] == "keras"}
    for trainer in args.trainer:
        mine = [r for r in rows if r["trainer"] == trainer]
        gaps = [r["f1"] - keras_f1[r["seed"]] for r in mine if r["seed"] in keras_f1]
        gap = f"{max(gaps, key=abs):+.1f} (largest)" if gaps and trainer != "keras" else ""
        print(
            f"{trainer:<8} {statistics.mean(r['em'] for r in mine):8.1f} "
            f"{statistics.mean(r['f1'] for r in mine):8.1f} {min(r['f1'] for r in mine):7.1f} "
            f"{statistics.mean(r['seconds'] for r in mine):7.1f}  {gap}"
        )


if __name__ == "__main__":
    main()
