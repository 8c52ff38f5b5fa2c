"""What running an upstream project's own test suite on zk:// takes, shared by
``celery_suite.py`` and ``kombu_suite.py``: its tests from the sdist of the
*installed* release (fetched from PyPI once), the failures of a JUnit report,
and the list of failures a zk run may have (each with its reason)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CACHE = ROOT / ".cache"


def say(tag: str, msg: str) -> None:
    print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sdist_tests(package: str, version: str, keep: tuple[str, ...]) -> Path:
    """``keep`` (paths inside the sdist: its ``t/`` package, its pytest settings)
    from the sdist of ``package==version``, fetched from PyPI once. Only those:
    with the sdist's own package beside them, the tests would import that copy
    instead of the installed one."""
    target = CACHE / f"{package}-{version}-tests"
    if (target / "t" / "integration" / "__init__.py").exists():
        return target
    CACHE.mkdir(exist_ok=True)
    say(package, f"fetching the {package} {version} sdist from PyPI")
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--disable-pip-version-check", "--no-binary", ":all:",
                        f"{package}=={version}", "-d", tmp], check=True)
        [archive] = Path(tmp).glob(f"{package}-{version}.tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        unpacked = Path(tmp) / f"{package}-{version}"
        staging = Path(tmp) / "tests"
        staging.mkdir()
        for name in keep:
            source = unpacked / name
            if source.is_dir():
                shutil.copytree(source, staging / name)
            elif source.exists():
                shutil.copy(source, staging / name)
        staging.rename(target)
    return target


def failures(junit: Path, xfailed: bool = False) -> dict[str, str]:
    """``{test id: first line of the failure}`` from a JUnit XML report; with
    ``xfailed``, the tests the suite marks as known to fail (pytest.xfail) too."""
    found: dict[str, str] = {}
    for case in ET.parse(junit).iter("testcase"):
        for element in case:
            if element.tag in ("failure", "error") or (
                    xfailed and element.tag == "skipped"
                    and element.get("type") == "pytest.xfail"):
                test_id = _test_id(case.get("classname", ""), case.get("name", ""))
                message = (element.get("message") or "").strip().splitlines()
                reason = message[0][:200] if message else element.tag
                if element.tag == "skipped":
                    reason = f"xfail on Redis (Celery marks it): {reason}"
                found[test_id] = reason
                break
    return found


def _test_id(classname: str, name: str) -> str:
    """``t/integration/test_x.py::cls::name`` from JUnit's dotted classname."""
    parts = classname.split(".")
    for index, part in enumerate(parts):
        if part.startswith("test_"):
            module = "/".join(parts[:index + 1]) + ".py"
            return "::".join([module, *parts[index + 1:], name])
    return f"{classname}::{name}"


def read_expected(path: Path) -> dict[str, str]:
    """The failures a zk run may have: ``{test id: why}``."""
    expected: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            test_id, _, reason = line.partition("  # ")
            expected[test_id.strip()] = reason.strip()
    return expected


def check(tag: str, failed: dict[str, str], expected: dict[str, str]) -> int:
    """0 when every failure is an expected one, else 1; says which is which."""
    unexpected = sorted(set(failed) - set(expected))
    for test_id in sorted(failed):
        mark = "expected" if test_id in expected else "UNEXPECTED"
        say(tag, f"failed: {test_id}: {failed[test_id]}  [{mark}: "
                 f"{expected.get(test_id, 'not in the list')}]")
    if unexpected:
        say(tag, f"{len(unexpected)} unexpected failure(s): FAIL")
        return 1
    say(tag, f"every failure ({len(failed)}) is an expected one: pass")
    return 0
