"""Entry point of the `tokenserve` console script."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from tokenserve.errors import TokenserveError
from tokenserve.host.python_heap import collector_paused
from tokenserve.host.user_cache import cache_dir


def _library_logs(verbose: bool) -> None:
    """absl's and TensorFlow's Python loggers show warnings only, unless `verbose`: a
    first-run export otherwise prints pages of INFO notices ("Function ... contains input
    name(s) ... with unsupported characters which will be renamed ...")."""
    level = logging.INFO if verbose else logging.WARNING
    for name in ("absl", "tensorflow"):
        logging.getLogger(name).setLevel(level)


def _load_tensorflow(verbose: bool = False) -> None:
    """Imports TensorFlow for a command that needs it, quietly unless `verbose`.

    TF 2.21 logs through absl before any log level applies (oneDNN and CUDA
    notices on every start), so stderr's file descriptor is pointed at
    /dev/null while TF loads and finds its devices; Python errors still show.
    """
    _persistent_xla_cache()
    if verbose:
        with _without_optional_modules(), collector_paused():
            import tensorflow  # noqa: F401 - with every notice
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        with _without_optional_modules(), collector_paused():
            import tensorflow as tf

        tf.config.list_physical_devices()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# Modules `import tensorflow` loads (through Keras and tf.keras) only for features tokenserve
# does not use, each behind an ImportError fallback: matplotlib.pyplot for Keras' image
# gallery, h5py for tf.keras' legacy HDF5 saving (Keras 3 imports h5py lazily, on use).
# Together 39 MB of RSS and about 1 s of start-up; importing them later still works.
OPTIONAL_TENSORFLOW_IMPORTS = ("matplotlib", "h5py")


@contextlib.contextmanager
def _without_optional_modules(names: tuple[str, ...] = OPTIONAL_TENSORFLOW_IMPORTS):
    """Makes `import NAME` raise ImportError inside the block, for the modules not yet
    imported (a None entry in sys.modules); lifts that on exit."""
    blocked = [name for name in names if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None
    try:
        yield
    finally:
        for name in blocked:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def _persistent_xla_cache() -> None:
    """Keeps XLA's compiled programs on disk, so a new process skips recompiling.

    Measured on a tiny model: time to first token 1011 ms cold, 329 ms warm.
    """
    flags = os.environ.get("TF_XLA_FLAGS", "")
    if "tf_xla_persistent_cache_directory" in flags:
        return
    directory = cache_dir("xla")
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["TF_XLA_FLAGS"] = f"{flags} --tf_xla_persistent_cache_directory={directory}".strip()


def build_parser() -> argparse.ArgumentParser:
    """Every command's flags. Building it (and `--help`) imports no TensorFlow: command
    modules import what they run inside `run`."""
    from tokenserve.cli import (bench, eval, export, finetune, generate, optimize, prune, serve,
                                train)

    parser = argparse.ArgumentParser(prog="tokenserve",
                                     description="Token generation serving on TensorFlow.")
    commands = parser.add_subparsers(dest="command", required=True)
    for module in (generate, export, train, serve, bench, eval, prune, optimize, finetune):
        module.add_parser(commands)
    for command in commands.choices.values():
        command.add_argument("--verbose", action="store_true",
                             help="show TensorFlow's and absl's own logs (start-up notices, "
                                  "export details)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # --help and bad flags exit here, before TF loads
    _library_logs(args.verbose)
    if getattr(args, "loads_tensorflow", True):
        _load_tensorflow(args.verbose)
    try:
        return args.run(args) or 0
    except TokenserveError as error:
        print(f"tokenserve {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`tokenserve generate ... | head`): stop quietly, as cat does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
