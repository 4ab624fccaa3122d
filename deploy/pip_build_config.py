"""The host's pip settings, rewritten for `pip` inside `docker build`, passed in as BuildKit build secrets.

A machine behind a TLS-intercepting proxy (or with its own package mirror) reaches PyPI only with its own CA
bundle and index settings. They must reach `pip` in a build without ever being written to an image layer or a
build argument (both are kept in the image's history), so the Dockerfiles read them only from secret mounts
(``RUN --mount=type=secret,id=pipconf`` and ``id=cacert``), which exist for that one command.

    python3 deploy/pip_build_config.py write OUT_DIR [--port N]
        OUT_DIR/pip.conf  index-url, extra-index-url, find-links and cert of the host's pip (``pip config list``
                          and its PIP_* variables), with cert = /run/secrets/cacert
        OUT_DIR/cacert    the host's CA bundle, when its pip has one
        OUT_DIR/serve/    links to the host's local indexes and wheel folders (file:// or plain paths), which a
                          build cannot read: they become http://127.0.0.1:N/<i>/ in pip.conf, served by
    python3 deploy/pip_build_config.py serve OUT_DIR --port N
        (loopback only; build with ``--network host`` so that pip in the build reaches it).

Pass them with ``docker build --secret id=pipconf,src=OUT_DIR/pip.conf --secret id=cacert,src=OUT_DIR/cacert``.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import subprocess
import sys
from pathlib import Path

SECRET_CERT = "/run/secrets/cacert"  # where `RUN --mount=type=secret,id=cacert` puts the bundle
_LIST_KEYS = ("extra-index-url", "find-links")  # settings that hold several space-separated values


def host_settings() -> dict[str, str]:
    """The host pip's effective global settings: its config files, then its PIP_* variables (which win)."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    settings: dict[str, str] = {}
    for line in listed.splitlines():
        name, _, value = line.partition("=")
        section, _, key = name.partition(".")
        if section in ("global", "install", ":env:"):
            settings[key] = value.strip().strip("'\"")
    for key in ("index-url", "cert", *_LIST_KEYS):
        env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if env:
            settings[key] = env
    return settings


def _local_path(location: str) -> Path | None:
    """The folder a file:// URL or a plain path names, or None for a URL a build can reach itself."""
    if location.startswith("file://"):
        return Path(location.removeprefix("file://"))
    if "://" not in location:
        return Path(location)
    return None


def build_config(settings: dict[str, str], out: Path, port: int) -> list[str]:
    """Writes OUT/pip.conf (and OUT/cacert, OUT/serve/); returns the lines of pip.conf."""
    serve = out / "serve"
    serve.mkdir(parents=True, exist_ok=True)
    served = 0

    def reachable(location: str, *, index: bool) -> str:
        nonlocal served
        path = _local_path(location)
        if path is None:
            return location
        if not path.is_dir():
            raise SystemExit(f"pip_build_config: {location} (in the host's pip settings) is not a folder")
        # An index's pages link to its files by relative paths (../../files/x.whl): serve its parent too.
        root, tail = (path.resolve().parent, path.resolve().name + "/") if index else (path.resolve(), "")
        link = serve / str(served)
        if not link.is_symlink():
            link.symlink_to(root)
        served += 1
        return f"http://127.0.0.1:{port}/{link.name}/{tail}"

    lines = ["[global]"]
    if "index-url" in settings:
        lines.append(f"index-url = {reachable(settings['index-url'], index=True)}")
    for key in _LIST_KEYS:
        values = [reachable(v, index=key != "find-links") for v in settings.get(key, "").split()]
        if values:
            lines.append(f"{key} = {' '.join(values)}")
    cert = settings.get("cert") or os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("SSL_CERT_FILE")
    if cert:
        shutil.copyfile(cert, out / "cacert")
        lines.append(f"cert = {SECRET_CERT}")
    else:
        (out / "cacert").write_text("")  # an empty secret: the build's own CA store is used
    (out / "pip.conf").write_text("\n".join(lines) + "\n")
    return lines


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """pip fetches hundreds of pages in a build: no line for each."""


def serve_forever(out: Path, port: int) -> None:
    """Serves OUT/serve/ on 127.0.0.1:PORT (the host's local indexes, for a build on the host network)."""
    handler = functools.partial(_QuietHandler, directory=str(out / "serve"))
    with http.server.ThreadingHTTPServer(("127.0.0.1", port), handler) as server:
        server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["write", "serve"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    if args.action == "write":
        args.out.mkdir(parents=True, exist_ok=True)
        lines = build_config(host_settings(), args.out, args.port)
        print(f"pip_build_config: {args.out}/pip.conf with {', '.join(line.split()[0] for line in lines[1:])}")
    else:
        serve_forever(args.out, args.port)


if __name__ == "__main__":
    main()
