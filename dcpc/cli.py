"""The ``dcpc`` command line: check, graph, schema, compile, run.

Exit codes: 0 success, 1 schedule errors (diagnostics printed), 2 usage errors.
No traceback reaches the user unless ``--debug`` is given.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from dcpc import __version__
from dcpc.diagnostics import Diagnostic, DiagnosticError
from dcpc.pipeline import STAGE_NAMES, Options, run

MAX_WORLD = 1024


def parse_worlds(text: str) -> list[int]:
    """'2..8' -> [2..8]; '2,4,8' -> [2, 4, 8]; '4' -> [4]."""
    worlds: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("..")
        try:
            first, last = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            raise click.BadParameter(
                f"'{part}' is not a group size; use N, A..B or a comma list like 2,4,8"
            ) from None
        if first > last:
            raise click.BadParameter(f"'{part}': the range is empty ({first} > {last})")
        if first < 2 or last > MAX_WORLD:
            raise click.BadParameter(f"'{part}': group sizes must lie in 2..{MAX_WORLD}")
        worlds.update(range(first, last + 1))
    return sorted(worlds)


class WorldRange(click.ParamType):
    name = "WORLDS"

    def convert(self, value: Any, param: Any, ctx: Any) -> list[int]:
        if isinstance(value, list):
            return value
        return parse_worlds(str(value))


WORLDS = click.option(
    "--world", "worlds", type=WorldRange(), default="2..8", show_default=True,
    help="group sizes to check: N, A..B or a comma list (2,4,8)",
)
DEBUG = click.option("--debug", is_flag=True, help="show Python tracebacks of internal errors")


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
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@WORLDS
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
@DEBUG
def check(files: tuple[str, ...], worlds: list[int], fmt: str, debug: bool) -> None:
    """Check schedules: structure, then races and deadlocks for every W asked."""

    def body() -> int:
        failed = 0
        results = []
        for file in files:
            try:
                c = run(file, Options(worlds=worlds), until="check")
            except DiagnosticError as err:
                failed += 1
                _report(err.diagnostics, fmt)
                result = {"file": file, "ok": False,
                          "diagnostics": [d.as_dict() for d in err.diagnostics]}
                report = getattr(getattr(err, "compilation", None), "hb_report", None)
                if report is not None:  # races and deadlocks as data, with timelines
                    result["hb"] = _jsonable(report.as_json())
                results.append(result)
                continue
            stats = c.hb_report.stats if c.hb_report is not None else {}
            results.append({"file": file, "ok": True, "worlds": [worlds[0], worlds[-1]],
                            "stats": _jsonable(stats)})
            if fmt == "text":
                click.echo(
                    f"{file}: ok (W {worlds[0]}..{worlds[-1]}, "
                    f"{len(c.schedule.step_list())} steps, {c.schedule.slots} slot(s); "
                    f"{sum(c.seconds.values()):.2f}s)"
                )
        if fmt == "json":
            click.echo(json.dumps({"results": results}, indent=2))
        return 1 if failed else 0

    _guard(debug, body)


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="write DOT, or render .svg/.png/.pdf with Graphviz's dot")
@click.option("--hb", is_flag=True, help="draw the unrolled happens-before graph instead")
@click.option("--world", "world", type=click.IntRange(2, 16), default=2, show_default=True,
              help="group size for --hb")
@DEBUG
def graph(file: str, output: str | None, hb: bool, world: int, debug: bool) -> None:
    """Print the schedule's dataflow graph (or, with --hb, its happens-before graph) as DOT."""

    def body() -> int:
        try:
            c = run(file, Options(worlds=[world], hb=False), until="check")
        except DiagnosticError as err:
            _report(err.diagnostics, "text")
            return 1
        if hb:
            from dcpc.check import hb as hb_check

            report = hb_check.check(c.schedule, [world])
            finding = report.findings[0] if report.findings else None
            dot = hb_check.hb_dot(c.schedule, world, finding)
        else:
            from dcpc.graph import to_dot

            dot = to_dot(c.graph)
        return _write_dot(dot, output)

    _guard(debug, body)


def _write_dot(dot: str, output: str | None) -> int:
    if output is None:
        click.echo(dot, nl=False)
        return 0
    target = Path(output)
    fmt = target.suffix.lstrip(".").lower()
    if fmt in ("dot", "gv", ""):
        target.write_text(dot)
        return 0
    if fmt not in ("svg", "png", "pdf"):
        raise click.UsageError(f"cannot render '{target.suffix}': use .dot, .svg, .png or .pdf")
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
        Path(output).write_text(text)
    else:
        click.echo(text, nl=False)


@main.command("compile")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--output", "outdir", type=click.Path(file_okay=False), required=True,
              help="directory for the generated modules")
@WORLDS
@click.option("--dump", type=click.Choice(STAGE_NAMES),
              help="stop after this stage and print what it produced")
@DEBUG
def compile_(files: tuple[str, ...], outdir: str, worlds: list[int], dump: str | None,
             debug: bool) -> None:
    """Check schedules and emit one Python module per schedule into DIR."""

    def body() -> int:
        failed = 0
        out = Path(outdir)
        for file in files:
            try:
                c = run(file, Options(worlds=worlds), until=dump or "emit")
            except DiagnosticError as err:
                failed += 1
                _report(err.diagnostics, "text")
                continue
            if dump:
                click.echo(_dump(c, dump))
                continue
            out.mkdir(parents=True, exist_ok=True)
            target = out / f"{c.schedule.schedule}.py"
            target.write_text(c.module_text or "")
            click.echo(f"{file} -> {target} ({sum(c.seconds.values()):.2f}s)")
        return 1 if failed else 0

    _guard(debug, body)


def _dump(c: Any, stage: str) -> str:
    if stage == "parse":
        return c.schedule.model_dump_json(indent=2)
    if stage == "graph":
        from dcpc.graph import to_dot

        return to_dot(c.graph)
    if stage == "check":
        return json.dumps(c.hb_report.as_json() if c.hb_report else {}, indent=2, default=str)
    if stage == "lower":
        import dataclasses

        return json.dumps(dataclasses.asdict(c.plan), indent=2, default=str)
    return c.module_text or ""


@main.command("run", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run_(args: tuple[str, ...]) -> None:
    """Compile a schedule and run it end to end on CPU across W processes.

    Example: dcpc run schedules/kimi_k3_dcp.yaml --world 2 --backend host --calls 20
    """
    from dcpc.demo import main as demo_main

    sys.exit(demo_main(list(args)))
