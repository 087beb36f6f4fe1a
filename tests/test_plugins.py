"""A third-party environment package, installed with pip, served by name and federated by fedse run;
and the errors an environment spec gets when it cannot be served."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from support import REPO

EXAMPLE = REPO / "examples" / "fedse-countdown"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The example package pip-installed (from a copy, so the checkout stays clean) into a folder of
    its own, which the processes below get on PYTHONPATH."""
    root = tmp_path_factory.mktemp("plugin")
    shutil.copytree(EXAMPLE, root / "src", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = root / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(root / "src")], check=True, timeout=300)
    return target


def with_path(site) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}


def test_the_installed_package_passes_its_own_test_and_the_conformance_suite(site):
    own = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests")],
                         env=with_path(site), capture_output=True, text=True, timeout=120)
    assert own.returncode == 0, own.stdout[-2000:]
    conformance = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(REPO / "tests" / "test_env_conformance.py"),
         "-k", "not fedse_tasks"], env={**with_path(site), "FEDSE_CONFORMANCE_ENVS": "countdown?largest=20"},
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert conformance.returncode == 0, conformance.stdout[-3000:]
    assert "countdown" in subprocess.run([sys.executable, "-m", "apps.cli", "tasks", "--envs", "countdown,maze"],
                                         env=with_path(site), capture_output=True, text=True, timeout=120).stdout


@pytest.mark.slow
def test_one_fedse_run_mixes_a_built_in_a_plugin_and_a_bridged_agentgym_server(site, tmp_path):
    from agentgym_servers import BabyAIServer

    results = tmp_path / "results"
    with BabyAIServer() as agentgym:
        envs = f"maze,countdown?largest=20,bab=agentgym:babyai@{agentgym.url}?max_turns=6"
        proc = subprocess.run([sys.executable, "-m", "apps.cli", "run", "--rounds", "1", "--results", str(results),
                               "--envs", envs, "--expert-demos", "4", "--explore-tasks", "4", "--eval-tasks", "4",
                               "--epochs", "1"], env=with_path(site), capture_output=True, text=True, timeout=480)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert agentgym.count("/step") > 0
    data = json.loads((results / "results.json").read_text())
    assert sorted(data["envs"]) == ["bab", "countdown", "maze"]
    for env, rows in data["envs"].items():
        assert [r["round"] for r in rows] == [0, 1] and rows[0]["test_tasks"] == 4, env
    assert data["envs"]["countdown"][0]["buffer"] > 0  # seeded by the plugin's expert


@pytest.mark.parametrize("envs,says", [
    ("maze,chess", "configuration error: --envs: environment chess: unknown environment 'chess'; known are maze, "
                   "wordle, babyai, textcraft, webshop"),
    ("x=os.path:no_such_factory", "configuration error: --envs: environment x: cannot import "
                                  "os.path:no_such_factory: AttributeError"),
    ("maze?turns=3", "configuration error: --envs: environment maze: no option 'turns'; it takes none"),
])
def test_fedse_run_refuses_a_spec_it_cannot_serve_with_one_line(envs, says, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "apps.cli", "run", "--envs", envs, "--results", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith(says), proc.stderr


def test_a_factory_that_fails_to_import_is_reported_bounded(tmp_path):
    pkg = tmp_path / "broken_env.py"
    pkg.write_text("raise RuntimeError('x' * 5000)\n")
    proc = subprocess.run([sys.executable, "-m", "services.env_server", "--envs", "b=broken_env:make",
                           "--address", "127.0.0.1:0", "--metrics-port", "-1"], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])})
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert line.startswith("configuration error: envs: environment b: cannot import broken_env:make: "
                           "RuntimeError: xxx") and len(line) < 800, line
