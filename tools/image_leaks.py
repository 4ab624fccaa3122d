"""Whether a built image holds this machine's package-index settings or its own CA certificates.

The Dockerfiles take pip's settings and CA bundle only from build secrets (deploy/pip_build_config.py), so
neither an index address, a local wheel folder, the build's loopback server nor a certificate that the host's
bundle adds to Debian's may appear in an image's history (`docker history --no-trunc`: every command and
build argument) or anywhere in its filesystem.

    python3 tools/image_leaks.py IMAGE...     exit 1 and each finding, if any image holds one

Run by the compose smoke on the images it built, and by tests/integration/test_image_leaks.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "deploy"))
from pip_build_config import host_settings

_PEM = re.compile(r"-----BEGIN CERTIFICATE-----\n(.*?)-----END CERTIFICATE-----", re.DOTALL)
LOOPBACK_SERVER = "127.0.0.1:876"  # pip_build_config's port in the smoke (8765) and image-gpu (8766)
_SKIP = "/proc /sys /dev /run/secrets /patterns"  # kernel file systems, the markers; /run/secrets: see below


def markers(settings: dict[str, str], image_bundle: str) -> list[str]:
    """Strings that must appear nowhere in an image: the hosts and folders of the host's pip indexes and wheel
    folders, the build's loopback server, and a line of each certificate the host's bundle has and the
    image's own bundle has not (the TLS-intercepting proxy's)."""
    found = {LOOPBACK_SERVER}
    for key in ("index-url", "extra-index-url", "find-links"):
        for location in settings.get(key, "").split():
            parts = urlsplit(location)
            if parts.scheme in ("http", "https") and parts.hostname not in ("pypi.org", "files.pythonhosted.org"):
                found.add(parts.netloc.rpartition("@")[2])  # the host, never its credentials
            elif parts.scheme in ("file", ""):
                found.add(parts.path.rstrip("/"))
    cert = settings.get("cert")
    if cert and Path(cert).is_file():
        ours = set(_PEM.findall(image_bundle))
        for body in _PEM.findall(Path(cert).read_text()):
            if body not in ours:
                found.add(body.splitlines()[len(body.splitlines()) // 2])  # a middle line: unique to it
    return sorted(m for m in found if m)


def image_bundle(image: str) -> str:
    """The image's own CA bundle (Debian's ca-certificates), empty if it has none."""
    result = _docker("run", "--rm", "--entrypoint", "cat", image, "/etc/ssl/certs/ca-certificates.crt", check=False)
    return result.stdout


def leaks(image: str, found_markers: list[str]) -> list[str]:
    """Each place in the image's history or filesystem where a marker appears."""
    history = _docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", image).stdout
    out = [f"{image}: history holds {m!r}" for m in found_markers if m in history]
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as patterns:
        patterns.write("\n".join(found_markers) + "\n")
        patterns.flush()
        prune = " -o ".join(f"-path {p}" for p in _SKIP.split())
        script = (
            f"find / \\( {prune} \\) -prune -o -type f -print0 | xargs -0 grep -l -F -f /patterns 2>/dev/null;"
            " find /run/secrets -mindepth 1 2>/dev/null"
        )
        mount = f"--volume={patterns.name}:/patterns:ro"
        result = _docker("run", "--rm", "--user=0", mount, "--entrypoint", "sh", image, "-c", script, check=False)
    out += [
        f"{image}: {path} holds one of this machine's index settings or certificates" for path in result.stdout.split()
    ]
    return out


def _docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check)


def main(images: list[str]) -> int:
    if not images:
        print(__doc__.splitlines()[3].strip(), file=sys.stderr)
        return 2
    settings = host_settings()
    found = []
    for image in images:
        marks = markers(settings, image_bundle(image))
        found += leaks(image, marks)
        print(f"image_leaks: {image}: looked for {len(marks)} markers in its history and files")
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
