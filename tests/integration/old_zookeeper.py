"""A ZooKeeper older than 3.6 (no ``addWatch``), for the fallback tests.

Debian's current release packages ZooKeeper 3.8; its previous one (bullseye)
packaged 3.4.13, which Debian's mirrors still serve. The jar is fetched once
into ``.cache/`` (its address read from bullseye's package index, so a
security update's new file name is followed) and laid out as an Apache
release under ``ZOOKEEPER_HOME`` form, with the logging jars the installed
``zookeeper`` package already brought.
"""
from __future__ import annotations

import lzma
import os
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from celery_zk.server import ZooKeeperInstall
from celery_zk.server.install import find_zookeeper

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / ".cache" / "zookeeper-3.4"
MIRROR = "http://deb.debian.org/debian"
INDEX = f"{MIRROR}/dists/bullseye/main/binary-all/Packages.xz"
PACKAGE = "libzookeeper-java"
#: Beside the jar: what ZooKeeper 3.4 logs through (Debian's zookeeper package needs them).
LOG_JARS = ("slf4j-api.jar", "slf4j-simple.jar", "log4j-1.2.jar")


def _package_url() -> str:
    with urllib.request.urlopen(INDEX, timeout=60) as reply:
        index = lzma.decompress(reply.read()).decode()
    for stanza in index.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines()
                      if ": " in line and not line.startswith(" "))
        if fields.get("Package") == PACKAGE:
            return f"{MIRROR}/{fields['Filename']}"
    raise RuntimeError(f"{PACKAGE} is not in {INDEX}")


def zookeeper_3_4() -> ZooKeeperInstall:
    """ZooKeeper 3.4 to run with celery_zk's launcher (fetched on first use)."""
    if not list(HOME.glob("zookeeper-3.4*.jar")):
        with tempfile.TemporaryDirectory() as tmp:
            deb = Path(tmp) / "package.deb"
            urllib.request.urlretrieve(_package_url(), deb)
            subprocess.run(["dpkg-deb", "-x", str(deb), tmp], check=True)
            [jar] = Path(tmp, "usr/share/java").glob("zookeeper-3.4*.jar")
            staging = Path(tmp) / "home"
            (staging / "lib").mkdir(parents=True)
            shutil.copy(jar, staging)
            HOME.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(HOME, ignore_errors=True)
            shutil.move(str(staging), HOME)
    lib = HOME / "lib"
    for name in LOG_JARS:
        if not (lib / name).exists():
            source = Path("/usr/share/java") / name
            if not source.exists():
                raise RuntimeError(f"{source} is missing: install Debian's zookeeper package")
            (lib / name).symlink_to(source)
    return find_zookeeper({**os.environ, "ZOOKEEPER_HOME": str(HOME)})
