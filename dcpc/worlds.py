"""``--world`` text -> group sizes or mesh shapes, with the same syntax and messages in
every command (``dcpc check``, ``compile``, ``graph``, ``run``).

Its own module because both dcpc.cli and dcpc.demo (``dcpc run``, which cli starts)
read ``--world``.
"""

from __future__ import annotations

import click

from dcpc.lang.mesh import MAX_WORLD, MeshWorld, WorldError, parse_count, parse_shapes


def parse_worlds(text: str) -> list[int]:
    """'2..8' -> [2..8]; '2,4,8' -> [2, 4, 8]; '4' -> [4]; mesh shapes (dcpc.lang.mesh)
    '2x4' -> [2x4], '2..4x8' -> [2x8, 3x8, 4x8], '2x2,2x4' -> both. Group sizes and
    shapes are not mixed: no schedule takes both (and a shape equals its W as an int)."""
    worlds: set[int] = set()
    shapes: set[MeshWorld] = set()
    for part in text.split(","):
        part = part.strip()
        if "x" in part:
            try:
                shapes.update(parse_shapes(part, MAX_WORLD))
            except WorldError as err:
                raise click.BadParameter(f"'{part}': {err}") from None
            continue
        lo, sep, hi = part.partition("..")
        try:
            first, last = parse_count(lo), parse_count(hi if sep else lo)
        except WorldError:
            raise click.BadParameter(
                f"'{part}' is not a group size; use N, A..B or a comma list like 2,4,8"
            ) from None
        if first > last:
            raise click.BadParameter(f"'{part}': the range is empty ({first} > {last})")
        if first < 2 or last > MAX_WORLD:
            raise click.BadParameter(f"'{part}': group sizes must lie in 2..{MAX_WORLD}")
        worlds.update(range(first, last + 1))
    if worlds and shapes:
        raise click.BadParameter(
            f"'{text}' mixes mesh shapes ({min(shapes)}) and group sizes ({min(worlds)}); a "
            "schedule with 'mesh:' takes shapes, one without takes group sizes")
    return sorted(shapes) if shapes else sorted(worlds)


def one_world(text: str, *, largest: int = MAX_WORLD) -> int:
    """``--world`` of a command that runs or draws one group size: the same syntax and
    messages as every other ``--world``, and exactly one size, at most ``largest``."""
    worlds = parse_worlds(text)
    if len(worlds) != 1:
        raise click.BadParameter(f"'{text}': this command takes one group size, such as 2")
    if worlds[0] > largest:
        raise click.BadParameter(f"'{text}': group sizes must lie in 2..{largest} here")
    return worlds[0]
