"""The `overstory` command: data, train, serve, eval, bench and quickstart.

Every job takes ``--config FILE`` plus dotted overrides (``train.lr=1e-5``). The exit code is 0 for a finished
job, 2 for a config or corpus error, and 1 for a job whose failed items exceed its ``max_failure_share`` or
that stopped on a request no retry mends.
A job is a module with a frozen config dataclass and a ``run(config)`` function (the table is ``overstory.jobs``);
a job's module is imported only when the command line names that job, to run it or to show its
``--help`` (its shorthand flags and config keys), so ``overstory --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
import typing
from typing import Any, Literal

from overstory.config_help import describe_config, source_notes
from overstory.core.config import ConfigError, load_config
from overstory.core.failures import TooManyFailures
from overstory.data_pipeline.corpus_files import CorpusError
from overstory.jobs import GROUP_HELP, JOBS, job_config_class
from overstory.retrieval.strategy import RequestRefused
from overstory.serving.client import ClientError

# Flags that are shorthand for the override of the same name, for the jobs whose config has the key.
SHORTHAND_FLAGS = ("out", "checkpoint", "data", "compare", "engine", "strategies")
# Shorthand flags of one job only (other jobs' configs have a `model` key that means something else).
JOB_FLAGS = {("serve", ""): ("model", "adapter", "retriever")}


def _add_job_args(parser: argparse.ArgumentParser) -> None:
    """What every job takes: a config file and dotted overrides."""
    parser.add_argument("--config", help="YAML config file (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted config overrides")


def _describe_job(parser: argparse.ArgumentParser, cls: type, job: tuple[str, str]) -> None:
    """Add to a job's parser the shorthand flags its config ``cls`` has (SHORTHAND_FLAGS, and JOB_FLAGS for ``job``),
    and list its config keys in the epilog.

    A flag needs a top-level key that takes a value (``data: str``, not a section ``data: PlannerDataConfig``);
    a Literal-typed one (``--engine``) takes its values as choices: --help shows them and a typo fails early.
    """
    hints = typing.get_type_hints(cls)
    notes = source_notes(cls)[1]
    for flag in (*SHORTHAND_FLAGS, *JOB_FLAGS.get(job, ())):
        if flag not in hints or dataclasses.is_dataclass(hints[flag]):
            continue
        choices = typing.get_args(hints[flag]) if typing.get_origin(hints[flag]) is Literal else None
        meaning = notes.get(flag, "").replace("%", "%%")  # argparse %-formats help text
        parser.add_argument(f"--{flag}", choices=choices,
                            help="; ".join(filter(None, (meaning, f"same as the override {flag}=VALUE"))))
    parser.epilog = describe_config(cls)


def _named_job(argv: list[str]) -> tuple[str, str] | None:
    """The job that ``argv`` names (``train planner_sft ...``, ``serve ...``), if any, found before parsing.

    The top-level parser takes no option with a value, so the first two words that are not options name it.
    """
    words = [arg for arg in argv if not arg.startswith("-")]
    if words and (words[0], "") in JOBS:
        return words[0], ""
    if len(words) > 1 and (words[0], words[1]) in JOBS:
        return words[0], words[1]
    return None


def build_parser(job: tuple[str, str] | None = None) -> argparse.ArgumentParser:
    """The ``overstory`` parser. Only ``job``'s module is imported: its config decides its flags and key list."""
    parser = argparse.ArgumentParser(prog="overstory", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    groups = parser.add_subparsers(dest="group", metavar="{" + ",".join(GROUP_HELP) + "}")
    raw = argparse.RawDescriptionHelpFormatter  # the epilog's key table keeps its columns
    for group, help_text in GROUP_HELP.items():
        names = [name for (g, name) in JOBS if g == group]
        single = names == [""]
        gp = groups.add_parser(group, help=help_text, description=help_text, formatter_class=raw)
        if not single:
            jobs = gp.add_subparsers(dest="job_name", metavar="{" + ",".join(names) + "}")
        for name in names:
            desc = JOBS[(group, name)][3]
            jp = gp if single else jobs.add_parser(name, help=desc, description=desc, formatter_class=raw)
            _add_job_args(jp)
            jp.set_defaults(job=(group, name))
            if job == (group, name):
                _describe_job(jp, job_config_class(group, name), job)
    return parser


def run_job(group: str, name: str, config_path: str | None, overrides: list[str]) -> Any:
    module, cls_name, fn_name, _ = JOBS[(group, name)]
    mod = importlib.import_module(module)
    config = load_config(getattr(mod, cls_name), config_path, overrides)
    return getattr(mod, fn_name)(config)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_named_job(argv))
    # Overrides may come before and after flags; argparse leaves the ones after a flag unparsed.
    args, rest = parser.parse_known_args(argv)
    stray = [item for item in rest if item.startswith("-") or "=" not in item]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if rest:
        args.overrides = [*getattr(args, "overrides", []), *rest]
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s: %(message)s"
    )
    for chatty in ("httpx", "bm25s"):  # an INFO line per request / index build drowns the progress bars
        logging.getLogger(chatty).setLevel(logging.WARNING)
    if args.group is None:
        parser.print_help()
        return 0
    job = getattr(args, "job", None)
    if job is None:  # a group without a job name: show the group's jobs
        parser.parse_args([args.group, "--help"])
        return 0
    overrides = list(args.overrides) + [f"{flag}={getattr(args, flag)}"
                                        for flag in (*SHORTHAND_FLAGS, *JOB_FLAGS.get(job, ()))
                                        if getattr(args, flag, None) is not None]
    try:
        run_job(job[0], job[1], args.config, overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except CorpusError as exc:  # a corpus.path that names no file, or a file that is not the corpus kind's format
        print(f"corpus error: {exc}", file=sys.stderr)
        return 2
    except TooManyFailures as exc:  # a job whose failed items (chunks, questions) exceed its max_failure_share
        print(f"job failed: {exc}", file=sys.stderr)
        return 1
    except (ClientError, RequestRefused) as exc:  # a request no retry mends (a refused role, no server there)
        print(f"request failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
