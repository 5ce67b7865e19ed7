"""The ``classgrad`` command line: parse, dispatch to one command module, turn errors into one line.

Holds the command registry (name -> module with ``add_arguments``/``main``) and ``main``. Errors
a user can cause (``ClassgradError``) print one line and exit with their code (2); Ctrl-C exits
130 after the driver has saved what it finished; anything else is a bug: one line, exit 1, and
the traceback only with ``--debug``; a reader that closes the pipe early (``| head``) ends it
quietly with 141, as for any Unix tool. Error lines and log lines pass through ``redact_text``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from classgrad.config.redaction import RedactingFilter, redact_text
from classgrad.errors import ClassgradError, first_line
from classgrad.version import __version__

# name -> module under classgrad.service.commands; each defines HELP, add_arguments(parser), main(args).
COMMANDS: dict[str, str] = {
    "run": "classgrad.service.commands.run",
    "status": "classgrad.service.commands.status",
    "estimate": "classgrad.service.commands.estimate",
    "inspect": "classgrad.service.commands.inspect",
    "verify": "classgrad.service.commands.verify",
    "similarity": "classgrad.service.commands.similarity",
    "score": "classgrad.service.commands.score",
    "aggregate": "classgrad.service.commands.aggregate",
    "plot": "classgrad.service.commands.plot",
    "submit": "classgrad.service.commands.submit",
    "jobs": "classgrad.service.commands.jobs",
}


def register_command(name: str, module: str) -> None:
    if name in COMMANDS:
        raise ValueError(f"command {name!r} is already registered")
    COMMANDS[name] = module


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="classgrad",
        description="Per-class gradients of PyTorch models, computed on Ray into a Zarr store.",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="debug logging (classgrad's own; other libraries stay at INFO)"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of unexpected errors")
    parser.add_argument("--version", action="version", version=f"classgrad {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(_main=module.main, _parser=cmd)
    return parser


def _configure_logging(args: argparse.Namespace) -> None:
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    # --verbose is classgrad's own debug output: other libraries' (botocore, s3fs) debug lines
    # carry request headers, an access key id included, so they stay at INFO.
    logging.basicConfig(
        level=logging.INFO if args.verbose else level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("classgrad").setLevel(level)
    for handler in logging.getLogger().handlers:  # any library's line may quote a URL with its password
        handler.addFilter(RedactingFilter())


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line parsed; an option its command does not know is refused by that command's
    parser (argparse's own would show the top-level usage for it), ending in one error line."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    _configure_logging(args)
    try:
        code = int(args._main(args) or 0)
        sys.stdout.flush()  # here, not at exit: a reader that stopped reading is seen below
        return code
    except BrokenPipeError:
        # `classgrad inspect STORE | head -1`: the reader is gone, as for any Unix tool. Point
        # stdout at /dev/null so the interpreter's last flush does not complain either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool stopped by a closed pipe
    except ClassgradError as exc:
        print(f"classgrad: error: {redact_text(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        from classgrad.service.driver_runtime.stopping import INTERRUPTED_LINE  # jobs stop --wait looks for it

        print(INTERRUPTED_LINE, file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug: one line unless --debug
        if args.debug:
            raise
        line = first_line(exc, with_type=True)  # a library's message can be a whole dump (Ray's: 40 lines)
        print(redact_text(f"classgrad: internal error: {line} (rerun with --debug for details)"), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
