"""benchmarks/gpu_pending.py: which GPU conformance cases a committed result settles.
A clean record settles its case while what the GPU run executes is what ran clean (the
key: the module, the runtime, the harness; benchmarks/gpu_keys.py), computed at the
record's commit from git where the record has none; where no key can be had, while
neither the file nor the device code changed since its commit. A failed record, an
unknown commit or a change keeps it pending with its reason, and the commands list
exactly the pending cases."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import gpu_keys as gk
from benchmarks import gpu_pending as gp

ROOT = Path(__file__).resolve().parents[2]
COPY, PULL = "schedules/ops/copy.yaml", "schedules/ops/pull.yaml"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=60).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no git history here ({exc})")


def _results(tmp_path: Path, commit: str, records: list[tuple[str, str, bool]],
             key: dict | None = None) -> Path:
    (tmp_path / f"gpu_conformance_{commit[:7]}.json").write_text(json.dumps({
        "commit": commit, "records": [{"ok": ok, "case": {"file": f, "world": w},
                                       **({"key": key} if key else {})}
                                      for f, w, ok in records]}))
    return tmp_path


def _rows(results: Path, root: Path = ROOT) -> dict[tuple[str, str], dict]:
    return {(r["file"], r["world"]): r
            for r in gp.pending(results, root=root, files=[COPY, PULL])}


def test_a_clean_record_at_head_settles_its_case_only(tmp_path: Path) -> None:
    if _git("status", "--porcelain", "--", COPY, *gp.DEVICE_PATHS):
        pytest.skip("this checkout has uncommitted device code (a clean clone runs it)")
    head = _git("rev-parse", "HEAD")
    rows = _rows(_results(tmp_path, head, [(COPY, "2", True), (PULL, "2", False)]))
    assert rows[(COPY, "2")]["settled"] == head and rows[(COPY, "2")]["why"] is None
    assert rows[(COPY, "2")]["rule"] == "key"  # computed at the commit, from git
    assert rows[(COPY, "4")]["why"] == "never ran clean on a GPU"
    assert rows[(PULL, "2")]["why"] == "never ran clean on a GPU"  # a failed run
    lines = gp.commands(list(rows.values()))
    assert not any(COPY in line and "--worlds 2," in line for line in lines)
    assert any(COPY in line and "--worlds 4,8 " in line for line in lines), lines


def test_a_change_since_the_run_or_an_unknown_commit_keeps_it_pending(tmp_path: Path) -> None:
    if _git("rev-parse", "--is-shallow-repository") == "true":
        pytest.skip("a shallow clone: its first commit is not the project's")
    first = _git("rev-list", "--max-parents=0", "HEAD").splitlines()[0]
    rows = _rows(_results(tmp_path, first, [(COPY, "2", True)]))
    assert rows[(COPY, "2")]["settled"] is None
    assert rows[(COPY, "2")]["why"] in (f"ran clean at {first}; the file changed since",
                                        f"ran clean at {first}; device code changed since")
    (tmp_path / "other").mkdir()
    rows = _rows(_results(tmp_path / "other", "0" * 40, [(COPY, "2", True)]))
    assert rows[(COPY, "2")]["why"] == f"ran clean at {'0' * 40}, a commit this clone does not have"


def test_the_shard_plans_run_every_pending_case_once_urgent_first() -> None:
    """plans(): every pending (file, world) in exactly one line of one shard; a file named
    first and a file that never ran open their shards with all their worlds; the others
    run at their smallest pending world before any second world."""
    rows = [{"file": f, "world": w, "settled": None if pend else "abc1234",
             "why": why if pend else None}
            for f, w, pend, why in [
                ("a.yaml", "2", True, "ran clean at x; the file changed since"),
                ("a.yaml", "4", True, "ran clean at x; the file changed since"),
                ("b.yaml", "2", True, "never ran clean on a GPU"),
                ("b.yaml", "8", True, "never ran clean on a GPU"),
                ("c.yaml", "2", False, None),
                ("c.yaml", "4", True, "ran clean at x; device code changed since"),
                ("d.yaml", "2x2", True, "ran clean at x; device code changed since"),
                ("d.yaml", "4x2", True, "ran clean at x; device code changed since"),
                ("e.yaml", "2", True, "ran clean at x; device code changed since")]]
    shards = gp.plans(rows, 2, first=["e.yaml"])
    got = [(f, w) for lines in shards for line in lines
           for w in line.split()[0].split(",") for f in line.split()[1:]]
    assert sorted(got) == sorted((r["file"], r["world"]) for r in rows if r["settled"] is None)
    assert shards == [["2,8 b.yaml", "2 a.yaml", "2x2 d.yaml", "4x2 d.yaml"],
                      ["2 e.yaml", "4 c.yaml", "4 a.yaml"]]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A clone of this checkout at HEAD (its own working tree to edit) and HEAD."""
    head = _git("rev-parse", "HEAD")
    if _git("status", "--porcelain", "--", "dcpc", "templates", COPY):
        pytest.skip("this checkout has uncommitted dcpc code (a clean clone runs it)")
    root = tmp_path_factory.mktemp("clone") / "repo"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(ROOT), str(root)],
                   check=True, timeout=120)
    subprocess.run(["git", "checkout", "-q", head], cwd=root, check=True, timeout=120)
    return root, head


def _edit(root: Path, rel: str, old: str, new: str) -> None:
    path = root / rel
    text = path.read_text()
    assert old in text, (rel, old)
    path.write_text(text.replace(old, new, 1))


def test_the_key_settles_what_the_gpu_would_run_and_names_what_changed(
        clone: tuple[Path, str], tmp_path: Path) -> None:
    """A clean record at HEAD, then edits in the clone's working tree: an op module's
    comment (device code to the commit rule, not to the module) and the CPU-only
    interpreter shim keep it settled by key; a template byte that reaches the module,
    a runtime file, a harness file make it pending, naming what changed."""
    root, head = clone
    results = _results(tmp_path, head, [(COPY, "2", True)])
    ops = "dcpc/ops/copy.py"
    _edit(root, ops, "\n", "\n# a comment: no module changes\n")
    _edit(root, "dcpc/runtime/local.py", "    memo: dict[Any, Any] = {}\n",
          "    memo: dict[Any, Any] = {}  # CPU only\n    memo.clear()\n")
    row = _rows(results, root)[(COPY, "2")]
    assert (row["settled"], row["rule"]) == (head, "key"), row
    assert gp._commit_rule(head, COPY, root) == f"ran clean at {head}; device code changed since"
    assert json.loads((results / gp.KEYS_FILE).read_text())[head][f"{COPY}@2"]  # cached
    _edit(root, "templates/module.py.j2", "from __future__ import annotations",
          "from __future__ import annotations  # one byte more")
    row = _rows(results, root)[(COPY, "2")]
    assert (row["settled"], row["why"]) == (None, f"module changed since {head}"), row
    subprocess.run(["git", "checkout", "-q", "--", "templates"], cwd=root, check=True)
    _edit(root, "dcpc/runtime/heap.py", "\n", "\nHEAP_EDIT = 1\n")
    _edit(root, "dcpc/harness/launch.py", "\n", "\nLAUNCH_EDIT = 1\n")
    row = _rows(results, root)[(COPY, "2")]
    assert row["why"] == f"runtime and harness changed since {head}", row
    ignored = {(r["file"], r["world"]): r for r in gp.pending(
        results, root=root, files=[COPY], ignore=("harness",))}[(COPY, "2")]
    assert ignored["why"] == f"runtime changed since {head}", ignored


def test_a_record_with_its_key_settles_without_git(clone: tuple[Path, str],
                                                   tmp_path: Path) -> None:
    """gpu_conformance's records carry their key: one of a commit this clone lacks
    settles by it while the key is the working tree's, else names the part."""
    root, _ = clone
    now = gp.tree_keys([(COPY, "2")], root)
    key = {"module": now["modules"][gk.case_id(COPY, "2")],
           **{part: now[part] for part in gk.CODE_PATHS}}
    row = _rows(_results(tmp_path, "0" * 40, [(COPY, "2", True)], key), root)[(COPY, "2")]
    assert (row["settled"], row["rule"]) == ("0" * 40, "key"), row
    other = tmp_path / "other"
    other.mkdir()
    row = _rows(_results(other, "0" * 40, [(COPY, "2", True)], {**key, "harness": "f" * 64}),
                root)[(COPY, "2")]
    assert row["why"] == f"harness changed since {'0' * 40}", row


def _is(test: ast.expr, device: str) -> bool:
    """Whether ``test`` is `<something> == device`."""
    return (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq) and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == device)


def test_the_cpu_only_code_left_out_of_the_key_runs_only_on_the_cpu() -> None:
    """Every use of what gpu_keys leaves out (CPU_ONLY_DEFS, CPU_ONLY_FILES) in dcpc/ sits
    under a test that the device is the CPU (`== "cpu"`, or the else of `== "cuda"`), or
    inside another of them: none runs in a GPU run."""
    names = {n for ns in gk.CPU_ONLY_DEFS.values() for n in ns}
    modules = {f[:-3].replace("/", ".") for f in gk.CPU_ONLY_FILES}
    uses = 0
    for path in sorted((ROOT / "dcpc").rglob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            used = (isinstance(node, ast.Name) and node.id in names
                    or isinstance(node, ast.ImportFrom) and (
                        node.module in modules or any(a.name in names for a in node.names)))
            if not used:
                continue
            uses += 1
            child, up, guarded = node, parents.get(node), False
            while up is not None and not guarded:
                if isinstance(up, ast.FunctionDef) and up.name in names:
                    guarded = True
                elif isinstance(up, ast.If):
                    conjuncts = up.test.values if isinstance(up.test, ast.BoolOp) and \
                        isinstance(up.test.op, ast.And) else [up.test]
                    guarded = (any(_is(t, "cpu") for t in conjuncts) and child in up.body
                               or _is(up.test, "cuda") and child in up.orelse)
                child, up = up, parents.get(up)
            assert guarded, f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
    assert uses >= 4  # worker's two imports, its call, LocalGroup's call
