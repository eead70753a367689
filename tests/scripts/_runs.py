"""What the worker scripts that train several runs in one job share (train_dp.py,
train_span.py, train_start_equal.py). Starting a job's processes is most of a short
run's time, so a test module runs its cases as one job, a trainer each in turn; each
case stays its own test on its own output.

The scripts are started as files (`epl-launch python tests/scripts/x.py`), so their
folder is on sys.path and `import _runs` finds this module.
"""

import logging
import os


class Messages(logging.Handler):
    """The messages logged while it is attached."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def add_run_argument(parser):
    """`--run NAME=FLAGS`, repeatable: a run of its own FLAGS (the script's flags,
    space-separated) into OUTPUT_DIR/NAME."""
    parser.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="a run of its own FLAGS, into OUTPUT_DIR/NAME (repeat: the runs in turn)",
    )


def runs(parser, args):
    """(name, its parsed flags, its output folder) of each `--run` of `args`."""
    for run in args.run:
        name, _, flags = run.partition("=")
        own = parser.parse_args([args.output_dir, *flags.split()])
        yield name, own, os.path.join(args.output_dir, name)


def check_config_took_effect(name, config, defaults, trainer):
    """Raises unless every key a run's `config` sets to other than the job's `defaults`
    is what its trainer runs with: a run that silently kept the defaults could still
    match Keras and pass its test."""
    for key, value in config.items():
        section, field = key.split(".")
        if value != defaults.get(key) and getattr(getattr(trainer.config, section), field) != value:
            raise RuntimeError(f"[{name}] the trainer's {key} is not {value!r}")
