"""The ``miles-multilora`` / ``python -m miles_multilora`` entry point.

miles-multilora train [key=value ...]      one-shot run (configs/train.yaml + hydra overrides)
miles-multilora serve [key=value ...]      long-running service (configs/service.yaml)
miles-multilora submit SPEC.yaml [...]     register adapters with a running service
miles-multilora status NAME | list | cancel NAME
miles-multilora schedule SCHEDULE.yaml [--wait] [--timeout S]  run a schedule of submits/cancels
miles-multilora show-config [train|service] [key=value ...]   print the composed, validated config
miles-multilora prepare-model [--cache-dir DIR]               convert the demo model once
"""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console
from rich.markup import escape

from miles_multilora import third_party_noise
from miles_multilora.errors import ConfigError

CLIENT_COMMANDS = ("submit", "status", "cancel", "list")
TOKEN_FILE_HELP = "file holding the bearer token (default: $MILES_MULTILORA_TOKEN; never on the command line)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles-multilora", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    defaults = {"train": "train", "serve": "service", "tinker-serve": "tinker"}
    for name, help_text in (
        ("train", "one-shot training run"),
        ("serve", "long-running training service"),
        ("tinker-serve", "Tinker-protocol server for the official tinker SDK"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument(
            "overrides", nargs="*", help="hydra overrides, e.g. trainer.output_dir=runs/x algo=dapo"
        )
        p.add_argument("--config-name", default=defaults[name])
        p.add_argument(
            "--show-warnings",
            action="store_true",
            help="also show the known third-party notices hidden by default (TE/Apex absent, deprecations)",
        )
    show = sub.add_parser("show-config", help="print the composed and validated config")
    show.add_argument("config_name", nargs="?", default="train")
    show.add_argument("overrides", nargs="*")
    prep = sub.add_parser("prepare-model", help="convert the demo model (GGUF) to an HF checkpoint dir once")
    prep.add_argument("--cache-dir", default=None)
    for name in CLIENT_COMMANDS:
        p = sub.add_parser(name, help=f"{name} adapters of a running service (HTTP API)")
        if name == "submit":
            p.add_argument("specs", nargs="+", help="adapter spec files (YAML or JSON)")
        elif name in ("status", "cancel"):
            p.add_argument("name")
        else:
            p.add_argument(
                "--all-runs", action="store_true", help="include earlier runs of re-registered names"
            )
        p.add_argument("--url", default=None, help="controller URL (default: $MILES_MULTILORA_URL)")
        p.add_argument("--token-file", default=None, help=TOKEN_FILE_HELP)
        p.add_argument("--state-dir", default=None, help="the service's controller state dir (finds its URL)")
    sched = sub.add_parser("schedule", help="submit/cancel adapters of a running service on a schedule file")
    sched.add_argument("schedule", help="schedule YAML (events: at/when + submit/cancel)")
    sched.add_argument("--wait", action="store_true", help="after the last event, wait until all have ended")
    sched.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    sched.add_argument("--poll", type=float, default=1.0, help="seconds between polls of the controller")
    sched.add_argument("--connect-timeout", type=float, default=120.0, help="wait this long for the service")
    sched.add_argument("--url", default=None, help="controller URL (default: $MILES_MULTILORA_URL)")
    sched.add_argument("--token-file", default=None, help=TOKEN_FILE_HELP)
    sched.add_argument("--state-dir", default=None, help="the service's controller state dir (finds its URL)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    if getattr(args, "show_warnings", False):
        os.environ[third_party_noise.SHOW_ENV] = "1"  # inherited by Ray's workers
    third_party_noise.install()
    try:
        if args.command in (*CLIENT_COMMANDS, "schedule"):
            from miles_multilora.api_token import read_token

            args.token = read_token(args.token_file, key="--token-file")
        if args.command in CLIENT_COMMANDS:
            from miles_multilora.controller.commands import run_command

            return run_command(args.command, args, console=console)
        if args.command == "schedule":
            from miles_multilora.controller.timed_submissions import run_schedule_command

            return run_schedule_command(
                args.schedule,
                url=args.url,
                token=args.token,
                state_dir=args.state_dir,
                wait=args.wait,
                timeout_s=args.timeout,
                connect_timeout_s=args.connect_timeout,
                poll_s=args.poll,
                console=console,
            )
        if args.command == "prepare-model":
            from miles_multilora.models.demo_model import prepare_demo_model

            console.print(f"demo model ready: {prepare_demo_model(args.cache_dir)}")
            return 0
        from miles_multilora.config.run import load_run_config, to_yaml

        if args.command == "show-config":
            console.print(to_yaml(load_run_config(args.config_name, args.overrides)), markup=False)
            return 0
        cfg = load_run_config(args.config_name, args.overrides)
        if not third_party_noise.showing_everything():
            console.print(f"[dim]{third_party_noise.NOTE}[/dim]", highlight=False, soft_wrap=True)
        if args.command == "train":
            from miles_multilora.launch.run import run_training

            run_training(cfg)
        elif args.command == "tinker-serve":
            from miles_multilora.launch.tinker_ranks import serve_forever

            serve_forever(cfg, console)
        else:
            from miles_multilora.launch.service import run_service

            run_service(cfg)
        return 0
    except ConfigError as exc:
        console.print(f"[red]config error[/red] {escape(exc.key)}: {escape(exc.message)}", highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
