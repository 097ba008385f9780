"""The library's build information and its log lines (SYMM_DEBUG)."""

import os
import subprocess
import sys

from ranks import SYMM_PARENT

import symm
from symm import _lib


def test_build_info_says_how_kernels_were_built():
    info = symm.build_info()
    assert set(info) == {"version", "version_code", "kernels", "kernels_build"}
    assert info["version"] == symm.__version__
    assert info["version_code"] == _lib.VERSION_CODE
    assert info["kernels"] in ("fatbin", "nvrtc")
    if info["kernels"] == "fatbin":
        assert info["kernels_build"].startswith("fatbin by nvcc")
    else:
        assert "NVRTC" in info["kernels_build"]


def _form_a_group(env_extra):
    """Forms a one-rank host group in a fresh interpreter with `env_extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYMM_DEBUG")}
    env.update(env_extra, PYTHONPATH=str(SYMM_PARENT))
    code = "import symm; g = symm.local_groups(1, backend='host')[0]; print('rank', g.rank)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_symm_debug_info_logs_group_formation_to_stderr():
    r = _form_a_group({"SYMM_DEBUG": "INFO"})
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("symm[")]
    formed = [line for line in lines if "group formed: host backend, world 1" in line]
    assert len(formed) == 1, r.stderr
    assert " INFO g" in formed[0] and ":r0/1 ffi::group: " in formed[0], formed[0]


def test_no_lines_without_symm_debug_and_a_warning_for_a_bad_value():
    r = _form_a_group({})
    assert r.returncode == 0, r.stderr
    assert "symm[" not in r.stderr
    r = _form_a_group({"SYMM_DEBUG": "loud"})
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("symm[")]
    assert len(lines) == 1 and " WARN " in lines[0] and "SYMM_DEBUG='loud'" in lines[0], r.stderr


def test_symm_debug_file_substitutes_the_pid(tmp_path):
    r = _form_a_group({"SYMM_DEBUG": "info", "SYMM_DEBUG_FILE": str(tmp_path / "symm.%h.%p.log")})
    assert r.returncode == 0, r.stderr
    assert "symm[" not in r.stderr
    (log,) = tmp_path.iterdir()
    host, pid = log.name.removeprefix("symm.").removesuffix(".log").rsplit(".", 1)
    text = log.read_text()
    assert f"symm[{host}:{pid}] INFO " in text and "group formed" in text, text
