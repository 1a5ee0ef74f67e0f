"""`diffattn <command>`: each command lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int`` (and may set ``DESCRIPTION``, the line its --help opens with;
else its docstring's first line).

Start-up is lazy: this module imports nothing of torch or the library, and only the module of the command that
runs is imported (``diffattn --help`` lists the commands from :data:`COMMANDS` alone). Everything heavy is
imported inside :func:`main`, so a Ctrl-C in the first seconds is the one line ``interrupted`` and exit 130."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys
import threading
import warnings
from collections.abc import Iterable
from typing import Any, NoReturn

from diffattn import __version__
from diffattn.system.atomic_files import Refused, printable
from diffattn.system.io_errors import EX_IOERR, io_error_in, io_error_line
from diffattn.system.untrusted import utf8_name
from diffattn.train.signals import QuitOnSecondSignal, Terminated, TrainingInterrupted

COMMANDS: dict[str, tuple[str, str]] = {
    "compare": ("diffattn.cli.compare",
                "train DIFF and its matched baseline on a built-in task, evaluate, write a report"),
    "study": ("diffattn.cli.study",
              "train DIFF, its baseline and variants on your text over LRs and seeds; report a CI and a verdict"),
    "train": ("diffattn.cli.train", "train a model (language model or classifier) from a TOML config"),
    "generate": ("diffattn.cli.generate", "sample text from a checkpoint with the KV cache"),
    "eval": ("diffattn.cli.eval",
             "evaluate a checkpoint: perplexity, needles, attention noise, outliers, quantization"),
    "info": ("diffattn.cli.info", "print a checkpoint's config, parameter counts and training state"),
    "convert": ("diffattn.cli.convert",
                "read a transformers Llama, Qwen2/2.5, Qwen3, Mistral, Gemma 3 or Phi-3 folder, or convert it "
                "to differential attention, exactly"),
    "export": ("diffattn.cli.export", "export a run: --to hf, a transformers folder (Llama / DiffLlama); --to vllm, a "
               "folder vLLM serves with diffattn's plugin"),
    "serve": ("diffattn.cli.serve", "serve a model with vLLM's OpenAI-compatible server (diffattn's vLLM plugin)"),
    "heads": ("diffattn.cli.heads", "show each head's distance preference (w, v, f-curve) in a distance-aware model"),
    "doctor": ("diffattn.cli.doctor", "check this machine: versions, device, each attention backend, what auto picks"),
    "plan": ("diffattn.cli.plan", "plan a training run's memory and FLOPs per device (DDP, FSDP2), allocating nothing"),
    "verdicts": ("diffattn.cli.verdicts", "verdict tables over finished studies: each arm against references, per text "
                 "and across texts"),
}


_MENTIONS_DEFAULT = re.compile(r"\bdefault\b", re.IGNORECASE)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help, as argparse.ArgumentDefaultsHelpFormatter does, but only when
    the help text does not already speak of its default (many say "default 1000, --quick 12" themselves) and the
    default tells the reader something (not None, False, "" or an empty list). Lists read as typed: a,b,c."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        default = action.default
        if (_MENTIONS_DEFAULT.search(help_) or default is None or default is False or default == ""
                or default is argparse.SUPPRESS or (isinstance(default, (list, tuple)) and not default)):
            return help_
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return help_  # a required positional has no default to show
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        # help strings go through %-formatting: a literal % in the default must survive it
        return f"{help_} (default: {shown.replace('%', '%%')})"


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose usage error is one line, exit 2 (argparse prints the usage block first):
    ``diffattn train: error: argument --threads: --threads must be at most 2 (this machine's CPUs), got 9``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {printable(message)}\n")


class _VersionAction(argparse.Action):
    """``--version``: torch's version is read only when asked for (importing torch takes a second or more)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        import torch  # lazy: the one option that needs it

        print(f"diffattn {__version__} (torch {torch.__version__})")
        parser.exit()


def command_in(argv: list[str]) -> str | None:
    """The command named in ``argv`` (the first word that is not an option), or None."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def build_parser(load: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command; only the commands in ``load`` (default: all) get their options, so their
    modules are imported: the others are listed with their help line alone."""
    load = COMMANDS if load is None else set(load)
    parser = OneLineParser(prog="diffattn", description="Differential and distance-aware attention toolkit.")
    parser.add_argument("--version", action=_VersionAction, help="show the versions of diffattn and torch")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_) in COMMANDS.items():
        if name not in load:
            sub.add_parser(name, help=help_, description=help_)
            continue
        mod = importlib.import_module(module)
        # A command module may name its own DESCRIPTION where its docstring's first line describes the module
        description = getattr(mod, "DESCRIPTION", None) or first_paragraph(mod.__doc__ or help_)
        p = sub.add_parser(name, help=help_, description=description, formatter_class=DefaultsHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def first_paragraph(doc: str) -> str:
    """A docstring's first paragraph on one line: a command's description (a first sentence that wraps onto a
    second line must not stop mid-sentence)."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def main(argv: list[str] | None = None) -> int:
    """Run ``diffattn ARGV`` (default: the process's arguments); -> the exit code. A Ctrl-C anywhere, the
    command's imports included, is the one line ``interrupted`` and 130."""
    try:
        with QuitOnSecondSignal():  # in every command: a second Ctrl-C quits at once, mid-computation too
            return _main(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        forget_keyboard_interrupt()
        return 130
    finally:
        if argv is None and threading.current_thread() is threading.main_thread():
            # Run as the program: the command is over and has said what it did. A Ctrl-C while the interpreter
            # shuts down (torch's exit handlers, joining threads) ends it at once instead of printing a
            # traceback from inside that clean-up.
            signal.signal(signal.SIGINT, signal.SIG_DFL)


def forget_keyboard_interrupt() -> None:
    """After a KeyboardInterrupt was handled: make ``python -m diffattn`` exit with the code returned (130).

    CPython records a KeyboardInterrupt that ended a string ``exec`` (dataclasses and namedtuple build their
    methods that way, so a Ctrl-C during the imports can land in one) even when a caller catches it, and under
    ``python -m`` it then ends the process by SIGINT after the exit code was chosen (a shell shows 130 either way;
    subprocess sees -2). A string exec that completes clears the record."""
    exec("pass")


def _main(argv: list[str] | None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    try:  # every name given is written into a UTF-8 file somewhere (resolved.toml, a checkpoint, a report)
        for arg in given:
            utf8_name(arg, "the argument")
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    chosen = command_in(given)
    parser = build_parser(load=[chosen] if chosen else [])
    # Commands that take free-form overrides (``train``: --section.field value) set ``_accepts_extra``.
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "_accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args._extra = extra
    # the command line as typed, for commands that print the exact command to continue an interrupted run
    args._argv = given
    threading.excepthook = _thread_exception
    warnings.showwarning = _show_warning
    try:
        return int(args._run(args) or 0)
    except TrainingInterrupted as e:  # a command that did not handle it itself: still one line, no traceback
        print(f"interrupted: {e}", file=sys.stderr)
        return e.exit_code
    except Terminated as e:
        print("terminated", file=sys.stderr)
        return e.exit_code
    except Refused as e:  # a refusal no command caught itself (a folder leading outside itself, a model too
        # large for this machine, RANK=abc): still one line, exit 2
        print(f"error: {printable(e)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly, as command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:
        err = io_error_in(e)
        if err is None:
            raise
        # a storage failure no command caught itself: still one line (path, cause, how to continue), exit 74
        print(io_error_line(err, then="run the same command again"), file=sys.stderr)
        return EX_IOERR


_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_python_showwarning = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    """diffattn's own warnings (a checkpoint fallback, a changed data order) as one line: "warning: ..."."""
    if issubclass(category, UserWarning) and os.path.abspath(filename).startswith(_PKG + os.sep):
        print(f"warning: {printable(message)}", file=sys.stderr if file is None else file)
        return
    _python_showwarning(message, category, filename, lineno, file, line)


def _thread_exception(args: threading.ExceptHookArgs) -> None:
    """TensorBoard's writer thread re-raises its storage failure (a full disk) in the training thread, which the
    command reports as one line: no traceback from the thread as well. Anything else as Python shows it."""
    if type(args.thread).__name__ == "_AsyncWriterThread" and io_error_in(args.exc_value) is not None:
        return
    threading.__excepthook__(args)


if __name__ == "__main__":
    sys.exit(main())
