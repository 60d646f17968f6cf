"""`meridian` entry point: argparse subcommands from a small registry.

A command module registers itself with the `command` decorator:

    from cli.main import command

    def add_arguments(parser):            # optional: the subcommand's own flags
        parser.add_argument("job", type=int)

    @command("logs", help="print a job's logs", add_arguments=add_arguments)
    def logs(args, client) -> int:       # client: cli.client.Client, already configured
        ...
        return 0

Every subcommand gets `--json`, `--url` and `--token`; `client.require_login()` is called for
it unless it was registered with `login_required=False`. A `CliError` raised anywhere becomes
"meridian <cmd>: error: <message>" on stderr (and {"error": ...} on stdout with --json) and its
exit code. Modules in COMMAND_MODULES are imported when main() runs; one that does not exist
yet (e.g. cli.logs before it lands) is skipped.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cli.client import Client, CliError, print_json

CommandFunction = Callable[[argparse.Namespace, Client], int]


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    run: CommandFunction
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    login_required: bool = True


COMMANDS: dict[str, Command] = {}
COMMAND_MODULES = ("cli.commands", "cli.logs")


def command(name: str, *, help: str, add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
            login_required: bool = True) -> Callable[[CommandFunction], CommandFunction]:
    """Registers the decorated `(args, client) -> exit code` function as `meridian NAME`."""

    def register(function: CommandFunction) -> CommandFunction:
        if name in COMMANDS and COMMANDS[name].run is not function:
            raise RuntimeError(f"meridian: two commands are named {name!r}")
        COMMANDS[name] = Command(name, help, function, add_arguments, login_required)
        return function

    return register


def _load_command_modules() -> None:
    for module in COMMAND_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


def build_parser() -> argparse.ArgumentParser:
    _load_command_modules()
    parser = argparse.ArgumentParser(prog="meridian", description="Submit and watch jobs on a Meridian fleet.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print machine-readable JSON")
    common.add_argument("--url", help="control plane URL (default: $MERIDIAN_URL, then the saved login)")
    common.add_argument("--token", help="API token (default: $MERIDIAN_TOKEN, then the saved login)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in sorted(COMMANDS):
        entry = COMMANDS[name]
        sub = subparsers.add_parser(name, help=entry.help, description=entry.help, parents=[common])
        if entry.add_arguments is not None:
            entry.add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not args.command:
        parser.print_help(sys.stderr)
        return 2
    entry = COMMANDS[args.command]
    try:
        client = Client.from_config(url=args.url, token=args.token)
        if entry.login_required:
            client.require_login()
        return int(entry.run(args, client) or 0)
    except CliError as exc:
        if getattr(args, "json", False):
            print_json({"error": exc.message})
        print(f"meridian {args.command}: error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"meridian {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # `python -m cli.main`: this module is __main__, but command modules register into cli.main.
    from cli.main import main as registered_main
    sys.exit(registered_main())
