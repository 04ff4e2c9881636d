"""The ``dcpc`` command line: check, graph, schema, compile, run.

Exit codes: 0 success, 1 schedule errors (diagnostics printed), 2 usage errors.
No traceback reaches the user unless ``--debug`` is given.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from dcpc import __version__
from dcpc.diagnostics import Diagnostic, DiagnosticError, printable
from dcpc.lang.mesh import MeshWorld, worlds_text
from dcpc.pipeline import DEFAULT_WORLDS, NAMES_W, STAGE_NAMES, Options, run, run_plan
from dcpc.worlds import one_world, parse_worlds


def _io_failure(diagnostics: list[Diagnostic]) -> bool:
    """An input or output that could not be read or written: a usage error (exit 2)."""
    from dcpc.files import IO

    return any(d.code == IO for d in diagnostics)


def _span(worlds: Sequence[int]) -> str:
    return f"W={worlds_text(worlds)}" if len(worlds) == 1 else f"W {worlds_text(worlds)}"


def _names_w(c: Any) -> str:
    """What makes a file one schedule per W, and where it first does."""
    where = f" (first at line {c.per_world_line})" if c.per_world_line else ""
    return f"{NAMES_W}{where}"


def _world_json(world: int) -> int | str:
    """A group size in JSON: W, or a mesh shape as its text ('2x4')."""
    return str(world) if isinstance(world, MeshWorld) else world


class WorldRange(click.ParamType):
    name = "WORLDS"

    def convert(self, value: Any, param: Any, ctx: Any) -> list[int]:
        if isinstance(value, list):
            return value
        return parse_worlds(str(value))


WORLDS = click.option(
    "--world", "worlds", type=WorldRange(), default=None,
    show_default="2..8; a mesh of several axes: 2..4 per axis",
    help="group sizes to check: N, A..B or a comma list (2,4,8)",
)
DEBUG = click.option("--debug", is_flag=True, help="show Python tracebacks of internal errors")
STRICT = click.option("--strict", is_flag=True,
                      help="treat warnings as errors (by default they never fail)")


def _report(diagnostics: list[Diagnostic], fmt: str) -> None:
    if fmt == "json":
        return
    for diag in diagnostics:
        text = diag.render()
        head, _, rest = text.partition("\n")
        color = "red" if diag.severity == "error" else "yellow"
        click.echo(click.style(head, fg=color, bold=True), err=True)
        if rest:
            click.echo(rest, err=True)


def _guard(debug: bool, body: Callable[[], int]) -> None:
    """Run a command body; turn any unexpected exception into a short message."""
    try:
        code = body()
    except click.exceptions.Exit:
        raise
    except click.ClickException:
        raise
    except BrokenPipeError:  # the reader left (`dcpc check ... | head -1`): stop as a
        # Unix tool does on SIGPIPE; stdout to /dev/null so that the exit's flush is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    except Exception as exc:  # an internal error: never a traceback unless --debug
        if debug:
            traceback.print_exc()
        click.echo(
            f"dcpc: internal error: {type(exc).__name__}: {exc}\n"
            "  hint: rerun with --debug and report the traceback",
            err=True,
        )
        sys.exit(3)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dcpc")
def main() -> None:
    """dcpc: prove and compile communication schedules for decode context parallelism."""


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path())  # read by dcpc.files
@WORLDS
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
@STRICT
@DEBUG
def check(files: tuple[str, ...], worlds: list[int], fmt: str, strict: bool,
          debug: bool) -> None:
    """Check schedules: structure, then races and deadlocks for every W asked."""

    def body() -> int:
        failed = 0
        io_failed = False
        results = []
        for file in files:
            try:
                c = run(file, Options(worlds=worlds or DEFAULT_WORLDS, strict=strict),
                        until="hb")
            except DiagnosticError as err:
                failed += 1
                io_failed = io_failed or _io_failure(err.diagnostics)
                _report(err.diagnostics, fmt)
                result = {"file": file, "ok": False,
                          "diagnostics": [d.as_dict() for d in err.diagnostics]}
                report = getattr(getattr(err, "compilation", None), "hb_report", None)
                if report is not None:  # races and deadlocks as data, with timelines
                    result["hb"] = _jsonable(report.as_json())
                results.append(result)
                continue
            _report(c.warnings, fmt)
            stats = c.hb_report.stats if c.hb_report is not None else {}
            done = c.per_world or c.worlds  # exactly the group sizes checked
            results.append({"file": file, "ok": True,
                            "worlds": [_world_json(w) for w in done],
                            "warnings": [d.as_dict() for d in c.warnings],
                            "stats": _jsonable(stats)})
            if fmt == "text":
                steps = ("" if c.per_world else
                         f"{len(c.schedule.step_list())} steps, ")  # a per-W file: per W
                click.echo(
                    f"{printable(file)}: ok ({_span(done)}, "
                    f"{steps}{c.schedule.slots} slot(s); {sum(c.seconds.values()):.2f}s)"
                )
                if c.per_world and isinstance(c.schedule.loop_world, tuple):  # per shape
                    why = ("a shift's perm names the ranks of one mesh shape" if any(
                        getattr(s.op, "perm", None) is not None for s in c.schedule.step_list())
                        else "a trip count, an index, an offset or an interleave names a "
                        "mesh axis' size")
                    click.echo(f"  {why}: each of {_span(done)} was unrolled and "
                               "checked on its own; no claim for any other shape")
                elif c.per_world:  # its unrolled steps name W (docs/hb-checker.md, loops)
                    click.echo(f"  {_names_w(c)}: each of {_span(done)} was unrolled and "
                               "checked on its own; no claim for any other W")
        if fmt == "json":
            click.echo(json.dumps({"results": results}, indent=2))
        return 2 if io_failed else 1 if failed else 0

    _guard(debug, body)


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


@main.command()
@click.argument("file", type=click.Path())  # read by dcpc.files
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="write DOT, or render .svg/.png/.pdf with Graphviz's dot")
@click.option("--hb", is_flag=True, help="draw the unrolled happens-before graph instead")
@click.option("--world", "world", default=None, callback=lambda ctx, param, value: (
    None if value is None else one_world(value, largest=16)),
    help="group size for --hb (one N in 2..16, or a mesh shape of at most 16 ranks; "
    "default 2, or 2x2... for a mesh)")
@DEBUG
def graph(file: str, output: str | None, hb: bool, world: int | None, debug: bool) -> None:
    """Print the schedule's dataflow graph (or, with --hb, its happens-before graph) as DOT."""
    if world is not None and not hb:
        raise click.UsageError("--world chooses the group size of --hb; add --hb or drop it")

    def body() -> int:
        from dcpc.pipeline import first_default_world

        nonlocal world
        world = world or first_default_world(file)  # 2, or a mesh's smallest shape (2x2)
        try:
            c = run(file, Options(worlds=[world], hb=False), until="check")
        except DiagnosticError as err:
            _report(err.diagnostics, "text")
            return 2 if _io_failure(err.diagnostics) else 1
        if hb:
            from dcpc.check import hb as hb_check

            report = hb_check.check(c.schedule, [world])
            finding = report.findings[0] if report.findings else None
            dot = hb_check.hb_dot(c.schedule, world, finding)
        else:
            from dcpc.graph import to_dot

            dot = to_dot(c.graph)
        try:
            return _write_dot(dot, output)
        except DiagnosticError as err:
            _report(err.diagnostics, "text")
            return 2

    _guard(debug, body)


def _write_dot(dot: str, output: str | None) -> int:
    if output is None:
        click.echo(dot, nl=False)
        return 0
    target = Path(output)
    fmt = target.suffix.lstrip(".").lower()
    if fmt in ("dot", "gv", ""):
        from dcpc.files import write_atomically

        write_atomically(target, dot)
        return 0
    if fmt not in ("svg", "png", "pdf"):
        raise click.UsageError(f"cannot render '{target.suffix}': use .dot, .svg, .png or .pdf")
    if not target.parent.is_dir():
        from dcpc.files import io_error

        raise io_error(target, f"cannot write the file: the folder '{target.parent}' "
                       "does not exist", hint="create it first, or write somewhere else")
    exe = shutil.which("dot")
    if exe is None:
        raise click.UsageError(
            "rendering needs Graphviz's 'dot' program, which is not installed; install it "
            "(Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz) or "
            "write DOT with -o graph.dot"
        )
    done = subprocess.run([exe, f"-T{fmt}", "-o", str(target)], input=dot, text=True,
                          capture_output=True, timeout=120)
    if done.returncode != 0:
        click.echo(f"dcpc: dot failed: {done.stderr.strip()}", err=True)
        return 1
    return 0


@main.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="write to a file")
def schema(output: str | None) -> None:
    """Print the schedule language's JSON Schema (for editors' YAML language servers)."""
    from dcpc.lang.schema import json_schema

    text = json.dumps(json_schema(), indent=2) + "\n"
    if output:
        from dcpc.files import write_atomically

        try:
            write_atomically(output, text)
        except DiagnosticError as err:
            _report(err.diagnostics, "text")
            sys.exit(2)
    else:
        click.echo(text, nl=False)


@main.command("compile")
@click.argument("files", nargs=-1, required=True, type=click.Path())  # read by dcpc.files
@click.option("-o", "--output", "outdir", type=click.Path(file_okay=False), required=True,
              help="directory for the generated modules")
@WORLDS
@click.option("--dump", type=click.Choice(STAGE_NAMES),
              help="stop after this stage and print what it produced (lower: the plan, "
                   "as JSON that --plan reads)")
@click.option("--plan", "plan_file", type=click.Path(),
              help="emit this plan (dumped by --dump lower) for the one FILE it was lowered "
                   "from, without lowering again: refused unless the file is unchanged and "
                   "the plan passes the checks")
@STRICT
@DEBUG
def compile_(files: tuple[str, ...], outdir: str, worlds: list[int], dump: str | None,
             plan_file: str | None, strict: bool, debug: bool) -> None:
    """Check schedules and emit one Python module per schedule into DIR."""
    if plan_file is not None and (len(files) != 1 or worlds or dump):
        raise click.UsageError("--plan takes the one schedule FILE the plan was lowered "
                               "from, and no --world (the plan records its worlds) or --dump")

    def body() -> int:
        from dcpc.files import write_atomically

        failed = 0
        io_failed = False
        out = Path(outdir)
        written: dict[str, str] = {}  # schedule name -> the file that produced it
        for file in files:
            try:
                if plan_file is not None:
                    c = run_plan(file, plan_file, Options(strict=strict))
                else:
                    c = run(file, Options(worlds=worlds or DEFAULT_WORLDS, strict=strict),
                            until=dump or "emit")
                name = c.schedule.schedule
                if not dump and name in written:
                    raise DiagnosticError([Diagnostic(
                        c.schedule.mark("schedule"), "duplicate-schedule",
                        f"schedule '{name}' is also the name of {written[name]}'s schedule; "
                        f"both would be written to {name}.py",
                        hint="give each schedule its own 'schedule:' name")])
                if not dump:
                    write_atomically(out / f"{name}.py", c.module_text or "",
                                     make_parents=True)
                    written[name] = file
            except DiagnosticError as err:
                failed += 1
                io_failed = io_failed or _io_failure(err.diagnostics)
                _report(err.diagnostics, "text")
                continue
            _report(c.warnings, "text")
            if dump:
                click.echo(_dump(c, dump))
                continue
            target = out / f"{c.schedule.schedule}.py"
            click.echo(f"{printable(file)} -> {printable(str(target))} "
                       f"({sum(c.seconds.values()):.2f}s)")
            if c.per_world and len(c.per_world) > 1:  # a loop names W: a class per W in it
                click.echo(f"  {_names_w(c)}: one class per W of {_span(c.per_world)}, "
                           "each checked on its own; any other W is refused at construction")
        return 2 if io_failed else 1 if failed else 0

    _guard(debug, body)


def _dump(c: Any, stage: str) -> str:
    if stage == "parse":
        return c.schedule.model_dump_json(indent=2)
    if stage == "graph":
        from dcpc.graph import to_dot

        return to_dot(c.graph)
    if stage == "check":
        return json.dumps([d.as_dict() for d in c.warnings], indent=2, default=str)
    if stage == "hb":
        return json.dumps(c.hb_report.as_json() if c.hb_report else {}, indent=2, default=str)
    if stage == "lower":
        from dcpc.codegen.plan import dump_plan

        return dump_plan(c.plan).rstrip("\n")
    return c.module_text or ""


@main.command("run", context_settings={"ignore_unknown_options": True},
              add_help_option=False)  # --help goes to dcpc.demo's parser: it lists the options
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run_(args: tuple[str, ...]) -> None:
    """Compile a schedule and run it end to end on CPU across W processes.

    Example: dcpc run schedules/kimi_k3_dcp.yaml --world 2 --backend host --calls 20
    (dcpc run --help lists the options)
    """
    from dcpc.demo import main as demo_main

    sys.exit(demo_main(list(args)))


if __name__ == "__main__":  # `python -m dcpc.cli` as `python -m dcpc`
    main()
