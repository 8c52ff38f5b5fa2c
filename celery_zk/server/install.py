"""Finding a local ZooKeeper installation and the Java runtime to run it.

The launcher (:mod:`celery_zk.server`) uses a ZooKeeper that is already
installed: an Apache release unpacked under ``ZOOKEEPER_HOME``, the Debian
package, or Homebrew. It never downloads anything; when nothing is found the
error says how to install it. See ``docs/launcher.md``, "Where ZooKeeper is
found (`celery_zk.server.install`)".
"""
from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass

from ..exceptions import ZooKeeperNotInstalled

__all__ = ["JVM_FLAGS", "SERVER_JVM_FLAGS", "ZooKeeperInstall", "find_zookeeper"]

MAIN_CLASS = "org.apache.zookeeper.server.quorum.QuorumPeerMain"

#: Packaged installs, tried in order after ``ZOOKEEPER_HOME``. A ``.jar`` entry
#: is a Debian-style jar directory; anything else is an Apache release layout.
SEARCH_PATHS: list[str] = [
    "/usr/share/java/zookeeper.jar",
    "/opt/homebrew/opt/zookeeper/libexec",
    "/usr/local/opt/zookeeper/libexec",
]

#: Jars added next to ``zookeeper.jar`` when present: Debian's manifest lacks
#: the last two (needed by the Netty/TLS server), and slf4j-simple makes the
#: server log to stderr (our log file) instead of nowhere.
EXTRA_JARS = ("slf4j-simple.jar", "netty-codec.jar", "netty-resolver.jar")

INSTALL_HELP = """\
Install ZooKeeper and a Java runtime, then try again:
  Debian/Ubuntu:  sudo apt-get install zookeeper
  macOS:          brew install zookeeper
  anywhere:       unpack an Apache ZooKeeper release (apache-zookeeper-X.Y.Z-bin.tar.gz)
                  and set ZOOKEEPER_HOME to its directory"""

_LOG_FLAGS = ("-Dorg.slf4j.simpleLogger.showDateTime=true",
              "-Dorg.slf4j.simpleLogger.dateTimeFormat=yyyy-MM-dd HH:mm:ss.SSS")
#: Fast start for tests and development: a small heap and the C1 compiler only.
JVM_FLAGS = ("-Xms32m", "-Xmx512m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", *_LOG_FLAGS)
#: What a production server runs with (the JVM's default collector and full JIT);
#: use it when measuring, since C1-only code serves requests markedly slower.
SERVER_JVM_FLAGS = ("-Xms512m", "-Xmx512m", *_LOG_FLAGS)


@dataclass(frozen=True)
class ZooKeeperInstall:
    """A usable ZooKeeper: the java binary and the classpath to run it with."""

    java: str
    classpath: tuple[str, ...]
    source: str

    def command(self, config_path: str, jvm_flags: Sequence[str] = JVM_FLAGS) -> list[str]:
        return [self.java, *jvm_flags, "-cp", os.pathsep.join(self.classpath),
                MAIN_CLASS, config_path]


def _release_classpath(home: str) -> list[str]:
    """Jars of an Apache release layout (also Homebrew's ``libexec``)."""
    jars = sorted(glob.glob(os.path.join(home, "zookeeper-*.jar")))
    jars += sorted(glob.glob(os.path.join(home, "lib", "*.jar")))
    if not any(os.path.basename(j).startswith("zookeeper-") for j in jars):
        return []
    conf = os.path.join(home, "conf")  # holds logback.xml / log4j.properties
    return ([conf] if os.path.isdir(conf) else []) + jars


def _jar_dir_classpath(zookeeper_jar: str) -> list[str]:
    """Debian: zookeeper.jar's manifest lists its dependencies."""
    if not os.path.isfile(zookeeper_jar):
        return []
    jar_dir = os.path.dirname(zookeeper_jar)
    extras = [os.path.join(jar_dir, name) for name in EXTRA_JARS]
    return [zookeeper_jar] + [jar for jar in extras if os.path.isfile(jar)]


def _find_java(environ: dict[str, str]) -> str | None:
    java_home = environ.get("JAVA_HOME")
    if java_home:
        candidate = os.path.join(java_home, "bin", "java")
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("java", path=environ.get("PATH"))


def find_zookeeper(environ: dict[str, str] | None = None) -> ZooKeeperInstall:
    """Locate ZooKeeper and java, or say exactly how to install them.

    A set ``ZOOKEEPER_HOME`` is authoritative: if it holds no ZooKeeper jar we
    fail rather than silently run some other installed version.
    """
    env = dict(os.environ if environ is None else environ)
    home = env.get("ZOOKEEPER_HOME")
    if home:
        classpath, source = _release_classpath(home), f"ZOOKEEPER_HOME={home}"
        if not classpath:
            raise ZooKeeperNotInstalled(
                f"ZOOKEEPER_HOME={home} contains no zookeeper-*.jar (looked in it and in "
                f"its lib/ directory). Point ZOOKEEPER_HOME at an Apache ZooKeeper release "
                f"directory, or unset it to use a packaged ZooKeeper.\n{INSTALL_HELP}")
    else:
        classpath, source = [], ""
        for path in SEARCH_PATHS:
            if path.endswith(".jar"):
                classpath = _jar_dir_classpath(path)
            else:
                classpath = _release_classpath(path)
            if classpath:
                source = path
                break
    if not classpath:
        raise ZooKeeperNotInstalled(
            f"No ZooKeeper installation found (ZOOKEEPER_HOME is not set; looked in "
            f"{', '.join(SEARCH_PATHS)}).\n{INSTALL_HELP}")
    java = _find_java(env)
    if java is None:
        raise ZooKeeperNotInstalled(
            f"Found ZooKeeper ({source}) but no java executable: set JAVA_HOME or put java "
            "on PATH (Debian/Ubuntu: sudo apt-get install default-jre-headless; "
            "macOS: brew install openjdk).")
    return ZooKeeperInstall(java=java, classpath=tuple(classpath), source=source)
