"""The built images hold none of this machine's package-index settings or certificates (tools/image_leaks.py).

They come in as build secrets only (deploy/pip_build_config.py). The images are the ones `make compose-smoke`
and `make image-gpu` build; a test whose image is not built here skips and says how to build it. The check
itself is shown to find a setting that a Dockerfile bakes in, in its history and in its files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import image_leaks  # noqa: E402 - tools/ holds scripts, not a package on the path

IMAGES = ["asyncgrpo-scorer:0.1.0", "asyncgrpo-cpu:0.1.0", "asyncgrpo-gpu:0.1.0"]
BASE = "asyncgrpo-local/python:3.11"  # deploy/local-base.sh
BAKED = "asyncgrpo-leak-probe:test"


def _docker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=False)


def _image_or_skip(image: str, how: str) -> None:
    if shutil.which("docker") is None or _docker("info").returncode != 0:
        pytest.skip("no Docker engine answers (deploy/engine.sh starts one)")
    if _docker("image", "inspect", image).returncode != 0:
        pytest.skip(f"{image} is not built here: {how}")


@pytest.mark.slow
@pytest.mark.parametrize("image", IMAGES)
def test_built_image_holds_no_index_setting_or_certificate(image):
    _image_or_skip(image, "make compose-smoke (or make image-gpu)")
    settings = image_leaks.host_settings()
    markers = image_leaks.markers(settings, image_leaks.image_bundle(image))
    assert image_leaks.LOOPBACK_SERVER in markers
    assert image_leaks.leaks(image, markers) == []


@pytest.mark.slow
def test_a_baked_in_setting_is_found_in_history_and_files(tmp_path):
    """A Dockerfile that writes a pip.conf (the mistake the build secrets avoid) is caught twice."""
    _image_or_skip(BASE, "deploy/local-base.sh")
    setting = f"find-links = http://{image_leaks.LOOPBACK_SERVER}5/2/"
    (tmp_path / "Dockerfile").write_text(
        f'FROM {BASE}\nARG PIP_SETTING\nRUN printf "[global]\\n%s\\n" "$PIP_SETTING" > /etc/pip.conf\n'
    )
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    built = subprocess.run(
        ["docker", "build", "-q", "--build-arg", f"PIP_SETTING={setting}", "-t", BAKED, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    try:
        found = image_leaks.leaks(BAKED, [image_leaks.LOOPBACK_SERVER])
    finally:
        _docker("image", "rm", "-f", BAKED)
    assert any("history holds" in line for line in found), found
    assert any("/etc/pip.conf holds" in line for line in found), found
