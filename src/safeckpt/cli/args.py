"""Argument types and the retention options shared by the ``safeckpt`` commands."""

from __future__ import annotations

import argparse

from .._policy.retention import Retention
from .._policy.schedule import POW2
from ..errors import ConfigError


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def add_retention_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("retention (a checkpoint is kept if any rule keeps it)")
    group.add_argument("--keep-last", type=positive_int, metavar="N", help="keep the N newest checkpoints")
    group.add_argument(
        "--keep-best", type=positive_int, metavar="K", help="keep the K best checkpoints by --metric"
    )
    group.add_argument(
        "--metric", metavar="NAME", help="the metric (saved with each checkpoint) that ranks them"
    )
    group.add_argument(
        "--mode", choices=("min", "max"), default="min", help="min: lower --metric is better (default)"
    )
    group.add_argument(
        "--keep-every",
        type=positive_int,
        metavar="N",
        help="keep every checkpoint whose step is a multiple of N",
    )
    group.add_argument(
        "--keep-milestones",
        type=milestones,
        metavar="STEPS",
        help="keep the checkpoints of milestone steps: 'pow2' (1, 2, 4, 8, ...) or a list like "
        "1000,5000,20000 (what the job's SaveSchedule(milestones=...) saves)",
    )


def retention_from_args(args: argparse.Namespace) -> Retention | None:
    """The :class:`Retention` the options ask for; None when no rule is given."""
    if args.keep_best is not None and not args.metric:
        raise ConfigError(
            "--keep-best needs --metric NAME: the metric that ranks checkpoints (e.g. --metric loss)."
        )
    if args.metric and args.keep_best is None:
        raise ConfigError(
            f"--metric {args.metric} has no effect without --keep-best K; add it, or drop --metric."
        )
    rules = (args.keep_last, args.keep_best, args.keep_every, args.keep_milestones)
    if all(rule is None for rule in rules):
        return None
    return Retention(
        keep_last=args.keep_last,
        keep_best=args.keep_best,
        metric=args.metric,
        mode=args.mode,
        keep_every=args.keep_every,
        keep_milestones=args.keep_milestones,
    )


def milestones(text: str) -> str | list[int]:
    """``pow2``, or milestone steps as a comma-separated list (``1000,5000,20000``)."""
    value = text.strip().lower()
    if value == POW2:
        return POW2
    try:
        steps = [int(part) for part in value.split(",")]
    except ValueError:
        steps = []
    if not steps or any(step < 0 for step in steps):
        raise argparse.ArgumentTypeError(
            f"must be 'pow2' or non-negative steps separated by commas (1000,5000), got {text!r}"
        )
    return steps


_SIZE_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4}


def byte_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB``, ``1048576``: a positive number of bytes.

    ``GB``/``MB`` are powers of 1000 (as in Hugging Face's ``max_shard_size``), ``GiB``/``MiB``
    powers of 1024.
    """
    value = text.strip().upper()
    binary = value.endswith("IB")
    unit = value[:-2] if binary else value.rstrip("B")
    number = unit.rstrip("KMGT")
    prefix = unit[len(number) :]
    try:
        amount = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a size like 5GB or 500MB, got {text!r}") from None
    if len(prefix) > 1 or (binary and not prefix):
        raise argparse.ArgumentTypeError(f"must be a size like 5GB or 500MB, got {text!r}")
    scale = 1024 ** ("KMGT".index(prefix) + 1) if binary else _SIZE_UNITS[prefix]
    size = int(amount * scale)
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be a positive size, got {text!r}")
    return size
