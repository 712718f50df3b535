"""Stage 1: the committed tree in a sandbox (`git archive`), never the real checkout."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from mutation.common import Stop, committed_text, log


# --- stage 1: sandbox ------------------------------------------------------------------------------
def make_tree(repo: Path, commit: str, tree: Path) -> None:
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(repo), "archive", commit], stdout=subprocess.PIPE)
    untar = subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout)
    archive.stdout.close()
    if archive.wait() != 0 or untar.returncode != 0:
        raise Stop(f"git archive {commit} | tar -x -C {tree} failed")
    for link, target in (("specchat/backends", "../backends"), ("specchat/shipped_profiles", "../profiles")):
        if not (tree / link).is_symlink():
            os.symlink(target, tree / link)


def check_imports(tree: Path, env: dict) -> None:
    code = ("import json, sys, specchat, specchat.backends.base as b, specchat.shipped_profiles as p, tests; "
            "assert not [f for f in sys.meta_path if getattr(f, '__module__', '').startswith('__editable__')], "
            "'the editable install still serves modules'; "
            "print(json.dumps([specchat.__file__, b.__file__, p.__file__, tests.__file__]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise Stop(f"sandbox import check failed in {tree}: {done.stderr.strip().splitlines()[-1:]}")
    for f in json.loads(done.stdout):
        if not os.path.abspath(f).startswith(str(tree) + os.sep):
            raise Stop(f"sandbox import check failed: {f} is imported instead of the sandbox's copy under {tree}")


def restore_tree(repo: Path, commit: str, tree: Path, modules: list[str]) -> None:
    """Put back any module a stopped run left mutated."""
    for m in modules:
        want = committed_text(repo, commit, m)
        if want is not None and (tree / m).read_text(encoding="utf-8") != want:
            log(f"[sandbox] restoring {m} (a previous run stopped with it mutated)")
            (tree / m).write_text(want, encoding="utf-8")
