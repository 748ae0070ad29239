"""The strict sandbox with Python installed under /tmp: a virtual environment made in a temporary folder (its
interpreter copied there, so that the sandbox's root must show that folder), running the executor's own tests
through it: the hostile programs, the python tool and the code task's judge."""

import os
import site
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


SELECTED = "hostile or python_tool or limits_output or forged"  # forged: the code task's judge, sandbox/code_harness.py


def test_executor_tests_pass_with_python_in_a_venv_under_tmp(strict):
    if not os.path.isdir("/tmp"):
        pytest.skip("no /tmp here")
    folder = tempfile.mkdtemp(prefix="grpo-venv-", dir="/tmp")
    try:
        venv = os.path.join(folder, "v")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--copies", venv], check=True, timeout=120)
        python = os.path.join(venv, "bin", "python")
        # this interpreter's packages (pytest, torch) for the venv's, through a .pth file in its site-packages
        found = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
        os.makedirs(found, exist_ok=True)
        with open(os.path.join(found, "outside.pth"), "w") as f:
            f.write("\n".join(site.getsitepackages()) + "\n")
        where = subprocess.run([python, "-c", "from sandbox import executor; print(executor._python())"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        assert where.startswith(folder + "/"), where  # the interpreter the sandbox runs lies under /tmp
        out = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", SELECTED,
                              os.path.join(ROOT, "tests", "test_executor.py")], cwd=ROOT, capture_output=True,
                             text=True, timeout=500, env=dict(os.environ, OMP_NUM_THREADS="1"))
        summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
        assert out.returncode == 0 and "passed" in summary and "skipped" not in summary, out.stdout[-4000:]
    finally:
        subprocess.run(["rm", "-rf", folder], check=False)
