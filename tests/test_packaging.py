"""The distribution as a user installs it without `-e`: the wheel holds every module and data file
the library and its CLI read, and nothing else (no measurement folders)."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sqjax", "pallas_kernels", "models", "train_qclassifier", "benchmarks")


def _tracked(pattern: str) -> set[str]:
    out = subprocess.run(["git", "ls-files", pattern], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return set(out.split())


def _source_copy(dest: Path) -> Path:
    """The files git would ship (tracked or not ignored), without a checkout's build/ leftovers, which
    setuptools would otherwise put in the wheel."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "pyproject.toml", "README.md",
                          *PACKAGES], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for f in out.split():
        if (ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / f, dest / f)
    return dest


def test_wheel_installs_every_module_and_data_file(tmp_path):
    src = _source_copy(tmp_path / "src")
    # --no-build-isolation: the test extra installs setuptools, so the build needs no network
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src),
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("sqjax-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    # every tracked module of the five packages, and the quality harness's documents
    wanted = {f for p in PACKAGES for f in _tracked(f"{p}/*.py") if not f.startswith("benchmarks/results/")}
    wanted |= _tracked("benchmarks/data/*.txt")
    assert wanted and not wanted - names, f"missing from the wheel: {sorted(wanted - names)}"
    assert not [n for n in names if n.startswith("benchmarks/results/")]
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == set(PACKAGES)
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "sqjax = sqjax.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()

    # installed apart from the checkout, the library finds its data there
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    probe = (
        "import benchmarks.quality_data as q, models, pallas_kernels, sqjax, sqjax.cli, train_qclassifier\n"
        "mods = (q, models, pallas_kernels, sqjax, train_qclassifier)\n"
        "print(all(m.__file__.startswith(%r) for m in mods))\n"
        "print(sorted(d.name for d in q.default_documents() if d.name.startswith('paper:')))\n"
        "print(len(sqjax.cli.demo_document()) > 1000)\n" % str(target)
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == ["True", "['paper:quest', 'paper:snapkv']", "True"], r.stdout


def test_benchmark_commit_is_the_sqjax_checkouts_only(tmp_path, monkeypatch):
    """Benchmark JSON's git_commit: this checkout's HEAD here; for a package installed in a project's
    own repository (its .venv), not the project's commit."""
    from benchmarks._meta import git_commit

    monkeypatch.delenv("SQJAX_GIT_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert git_commit().removesuffix("-dirty") == head == git_commit(ROOT).removesuffix("-dirty")

    project, site = tmp_path / "project", tmp_path / "project/.venv/lib/python3.12/site-packages"
    site.mkdir(parents=True)
    (project / "app.py").write_text("print('hi')\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for args in (["init", "-q"], ["add", "app.py"], ["commit", "-qm", "project"]):
        subprocess.run(git + args, cwd=project, check=True, capture_output=True)
    assert git_commit(site) == "uncommitted"
    monkeypatch.setenv("SQJAX_GIT_COMMIT", "abc123")
    assert git_commit(site) == "abc123"
