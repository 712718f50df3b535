"""scripts/gpu_check.sh, the device check: its CPU run (`--cpu`) passes with real results, in an
environment holding only what a bare CUDA machine has (torch, transformers, safetensors and their
own dependencies) plus the wheels scripts/gpu_check/wheels.txt lists; bad input is refused in one
line; on a CUDA machine, the full check passes."""
from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from tests.native.tiny import LAYOUTS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
MACHINE_HAS = ("torch", "transformers", "safetensors")
# the app's own packages, which a bare GPU machine lacks (rich too: only the app's progress bars want it)
APP_ONLY = ("textual", "prompt-toolkit", "pydantic", "gguf", "platformdirs", "rich", "httpx", "llama-cpp-python")


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def listed_wheels() -> list[tuple[str, str]]:
    """(requirement, module) per line of wheels.txt."""
    lines = (ROOT / "scripts" / "gpu_check" / "wheels.txt").read_text().splitlines()
    return [tuple(line.split()[:2]) for line in lines if line.strip() and not line.startswith("#")]


def dependency_closure(names, excluded) -> dict[str, metadata.Distribution]:
    """The installed distributions `names` need to run, following requirements without extras."""
    found, todo = {}, list(names)
    while todo:
        name = todo.pop()
        if _key(name) in found or _key(name) in excluded:
            continue
        dist = found[_key(name)] = metadata.distribution(name)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def make_site(site: Path, with_wheels: bool) -> Path:
    """A site folder of links to only the machine's packages and, `with_wheels`, the listed ones
    (installed with --no-deps, as gpu_check.sh does), for `python -S`, which then sees no other
    site-packages."""
    site.mkdir(parents=True, exist_ok=True)
    wheels = [metadata.distribution(Requirement(r).name) for r, _ in listed_wheels()] if with_wheels else []
    dists = list(dependency_closure(MACHINE_HAS, {_key(n) for n in APP_ONLY}).values()) + wheels
    for dist in dists:
        assert dist.files is not None, f"{dist.metadata['Name']} has no RECORD to link its files from"
        for top in {f.parts[0] for f in dist.files} - {"..", "__pycache__"}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    return site


@pytest.fixture(scope="module")
def bare_site(tmp_path_factory) -> Path:
    return make_site(tmp_path_factory.mktemp("bare-site"), with_wheels=True)


def bare_env(site: Path) -> dict:
    return dict(os.environ, PYTHON=f"{sys.executable} -S", PYTHONPATH=str(site), OMP_NUM_THREADS="1")


def test_the_bare_site_lacks_the_app_packages_and_holds_the_listed_wheels(bare_site):
    """Else the CPU run below would prove nothing about what a bare machine can import."""
    absent = ["textual", "prompt_toolkit", "pydantic", "platformdirs", "rich", "httpx", "specchat"]
    present = ["torch", "transformers", "safetensors"] + [module for _, module in listed_wheels()]
    code = ("import importlib.util, json; print(json.dumps({m: importlib.util.find_spec(m) is not None "
            f"for m in {absent + present!r}}}))")
    done = subprocess.run([sys.executable, "-S", "-c", code], env=bare_env(bare_site), cwd=str(bare_site),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert not any(found[m] for m in absent), found
    assert all(found[m] for m in present), found


@pytest.mark.timeout(600)  # compiling the decode graphs on a first run; seconds once torch has cached them
def test_the_cpu_check_passes_with_real_results_on_a_bare_site(bare_site, tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), "--cpu", "--threads", "1", "--out", str(out)],
                          env=bare_env(bare_site), cwd=str(tmp_path), capture_output=True, text=True, timeout=590)
    log = (out / "log.txt").read_text() if (out / "log.txt").exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + log[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "passed" and report["mode"] == "cpu"
    assert (out / "summary.txt").read_text().startswith("gpu check, cpu: passed")
    parts, plan = report["parts"], report["plan"]
    for name in ("logits", "parity", "compiled", "speed", "speed_compiled"):
        assert parts[name]["status"] == "passed" and parts[name]["skipped"] == [], (name, parts[name])

    rows = parts["logits"]["result"]["rows"]
    names = set(LAYOUTS) | {"llama-gguf-F32", "llama-gguf-Q4_1"}
    assert {(r["checkpoint"], r["precision"]) for r in rows} == {(n, p) for n in names for p in plan["precisions"]}
    for r in rows:
        assert r["engine_error"] <= r["bound"] and r["argmax_agreement"] > 0.9, r
        assert r["precision"] != "float32" or (r["greedy_equal_to_generate"] and r["engine_error"] < 1e-4), r

    grids = {g["precision"]: g for g in parts["parity"]["result"]["grids"]}
    assert set(grids) == set(plan["precisions"])
    for g in grids.values():
        assert g["cases"] == 6 * len(plan["parity_depths"]) * 3 * plan["parity_prompts"], g
        assert g["mismatch"] == g["errors"] == 0, g["differences"]
        assert g["tokens_per_pass"]["self"] > 1.5  # drafts were really verified and kept
    assert grids["bfloat16"]["strict"] is True and grids["bfloat16"]["identical"] == grids["bfloat16"]["cases"]

    compiled = parts["compiled"]["result"]
    assert compiled["static_shapes"] and compiled["decode_logits"]["passed"]
    assert compiled["mismatch"] == compiled["errors"] == 0 and compiled["graphs_compiled"] > 0
    drafters = ("dflash", "mtp+lookup", "draft (eager)", "ngram")  # hidden states out of the graphs, and not
    assert [k for k in compiled["cases"] if k.startswith("speculative")] == [
        f"speculative {d} depth 3 {s}" for d in drafters for s in ("greedy", "t0.8")]

    (row,) = parts["speed"]["result"]["rows"]
    assert row["engine_tok_s"] > 0 and row["transformers_tok_s"] > 0 and row["loop_passes_per_s"] > 0
    assert [int(k) for k in row["verify_ms"]] == plan["verify_rows"] and min(row["verify_ms"].values()) > 0
    # float32: 4 bytes a weight streamed, the tied head's included once (the norms are not matrices)
    assert 3.9 * row["parameters"] < row["bytes_per_token"]["weights"] <= 4 * row["parameters"]
    assert 0 < row["fraction_of_measured_bound"] and row["bound_tok_s_measured"] > 0
    (row,) = parts["speed_compiled"]["result"]["rows"]
    assert row["compiled"] and row["static_shapes"] and row["engine_tok_s"] > 0 and row["first_reply_s"] > 0


def test_a_listed_package_the_machine_lacks_is_named_in_one_line(tmp_path):
    """Without the listed packages installed, and no way to install them here (no pip in the bare
    site; no wheels, unless the folder was filled), the check does not start."""
    site = make_site(tmp_path / "site", with_wheels=False)
    done = subprocess.run(["bash", str(SCRIPT), "--cpu", "--out", str(tmp_path / "out")], env=bare_env(site),
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    requirements = " ".join(r for r, _ in listed_wheels())
    assert done.returncode == 2 and done.stderr.startswith(f"gpu_check: {requirements} not installed"), done.stderr
    assert done.stderr.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,says", [
    (["--cpu", "--parts", "logits,nope"], "unknown part 'nope'"),
    (["--cpu", "--threads", "-1"], "--threads must be 0 or more"),
    (["--cpu", "--no-such-flag"], "unrecognized arguments"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, says):
    done = subprocess.run(["bash", str(SCRIPT), *args, "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_no_output_folder_is_one_line_and_exit_2():
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run(["bash", str(SCRIPT), "--cpu"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr == "gpu_check: no output folder: pass --out DIR (or set OUT)\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device: the check runs there")
def test_without_cuda_the_device_check_points_to_cpu(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--cpu runs the CPU check" in done.stderr and done.stderr.count("\n") == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the check's GPU half: "
                    "bash scripts/gpu_check.sh on a CUDA machine, docs/gpu-check.md)")
@pytest.mark.timeout(560)
def test_the_device_check_passes_on_cuda(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True, timeout=550)
    summary = (tmp_path / "summary.txt").read_text() if (tmp_path / "summary.txt").exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + summary
    assert json.loads((tmp_path / "report.json").read_text())["status"] == "passed"
