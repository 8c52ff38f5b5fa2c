"""zoo.cfg rendering and ZooKeeper discovery, without starting java."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from celery_zk.exceptions import ZooKeeperNotInstalled
from celery_zk.server import (
    Peer,
    TLSConfig,
    ZooKeeperEnsemble,
    ZooKeeperServer,
    install,
    render_config,
)
from celery_zk.server import ensemble as ensemble_module
from celery_zk.server.install import find_zookeeper


def parse(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines())


def fake_java(tmp_path: Path) -> dict[str, str]:
    java_home = tmp_path / "jdk"
    (java_home / "bin").mkdir(parents=True)
    java = java_home / "bin" / "java"
    java.write_text("#!/bin/sh\n")
    java.chmod(java.stat().st_mode | stat.S_IXUSR)
    return {"JAVA_HOME": str(java_home), "PATH": ""}


def test_single_server_config() -> None:
    conf = parse(render_config(data_dir="/d", host="127.0.0.1", port=2181))
    assert conf["tickTime"] == "2000"   # ZooKeeper's default: sessions of 4-40 s, as users get
    assert conf["dataDir"] == "/d"
    assert conf["clientPort"] == "2181"
    assert conf["clientPortAddress"] == "127.0.0.1"
    assert set(conf["4lw.commands.whitelist"].split(",")) >= {"ruok", "srvr"}
    assert conf["admin.enableServer"] == "false"
    assert "maxClientCnxns" not in conf   # ZooKeeper's default (60 per IP), as users run it
    assert not any(key.startswith(("server.", "ssl.", "secure")) for key in conf)


def test_extra_config_overrides_defaults() -> None:
    conf = parse(render_config(data_dir="/d", host="127.0.0.1", port=1,
                               extra_config={"tickTime": "2000", "jute.maxbuffer": "9"}))
    assert conf["tickTime"] == "2000"
    assert conf["jute.maxbuffer"] == "9"


def test_ensemble_config() -> None:
    peers = [Peer(1, "127.0.0.1", 1001, 1002), Peer(2, "127.0.0.1", 1003, 1004),
             Peer(3, "127.0.0.1", 1005, 1006)]
    conf = parse(render_config(data_dir="/d", host="127.0.0.1", port=2181, peers=peers))
    assert conf["server.1"] == "127.0.0.1:1001:1002"
    assert conf["server.3"] == "127.0.0.1:1005:1006"
    assert conf["initLimit"] == "10"
    assert conf["syncLimit"] == "5"


def test_tls_config() -> None:
    tls = TLSConfig("/k.p12", "kp", "/t.p12", "tp", client_auth="want", store_type="PKCS12")
    conf = parse(render_config(data_dir="/d", host="127.0.0.1", port=None, secure_port=2281,
                               tls=tls))
    assert "clientPort" not in conf
    assert conf["secureClientPort"] == "2281"
    assert conf["secureClientPortAddress"] == "127.0.0.1"
    assert conf["serverCnxnFactory"] == "org.apache.zookeeper.server.NettyServerCnxnFactory"
    assert conf["ssl.keyStore.location"] == "/k.p12"
    assert conf["ssl.keyStore.password"] == "kp"
    assert conf["ssl.trustStore.location"] == "/t.p12"
    assert conf["ssl.trustStore.password"] == "tp"
    assert conf["ssl.clientAuth"] == "want"
    assert conf["ssl.keyStore.type"] == conf["ssl.trustStore.type"] == "PKCS12"


def test_tls_config_rejects_bad_client_auth() -> None:
    with pytest.raises(ValueError, match="client_auth"):
        render_config(data_dir="/d", host="h", port=1, secure_port=2,
                      tls=TLSConfig("k", "p", "t", "p", client_auth="always"))


def test_secure_port_needs_tls() -> None:
    with pytest.raises(ValueError, match="TLSConfig"):
        render_config(data_dir="/d", host="h", port=1, secure_port=2)


def test_server_paths_and_addresses(tmp_path: Path) -> None:
    zk = ZooKeeperServer(port=12345, data_dir=str(tmp_path / "zk"))
    assert zk.hosts == "127.0.0.1:12345"
    assert zk.url == "zk://127.0.0.1:12345"
    assert zk.log_path == str(tmp_path / "zk.log")
    assert not zk.running and zk.pid is None
    assert parse(zk.render_config())["dataDir"] == str(tmp_path / "zk")


def test_temporary_data_dir_removed_on_close() -> None:
    zk = ZooKeeperServer()
    assert zk.port is not None and zk.port > 0
    tmp_root = os.path.dirname(zk.data_dir)
    assert os.path.isdir(tmp_root)
    zk.close()
    assert not os.path.exists(tmp_root)


def test_find_zookeeper_home(tmp_path: Path) -> None:
    home = tmp_path / "apache-zookeeper-3.8.4-bin"
    (home / "lib").mkdir(parents=True)
    (home / "conf").mkdir()
    for jar in ("zookeeper-3.8.4.jar", "zookeeper-jute-3.8.4.jar", "netty-handler.jar"):
        (home / "lib" / jar).write_bytes(b"")
    found = find_zookeeper({"ZOOKEEPER_HOME": str(home), **fake_java(tmp_path)})
    assert found.java == str(tmp_path / "jdk" / "bin" / "java")
    assert str(home / "lib" / "zookeeper-3.8.4.jar") in found.classpath
    assert str(home / "lib" / "netty-handler.jar") in found.classpath
    assert str(home / "conf") in found.classpath
    cmd = found.command("/x/zoo.cfg")
    assert cmd[0] == found.java
    assert cmd[-2:] == [install.MAIN_CLASS, "/x/zoo.cfg"]


def test_find_zookeeper_debian_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for jar in ("zookeeper.jar", "slf4j-simple.jar", "netty-codec.jar"):
        (tmp_path / jar).write_bytes(b"")
    monkeypatch.setattr(install, "SEARCH_PATHS", [str(tmp_path / "zookeeper.jar")])
    found = find_zookeeper(fake_java(tmp_path))
    # netty-resolver.jar is absent here, so it must not be on the classpath.
    assert found.classpath == (str(tmp_path / "zookeeper.jar"),
                               str(tmp_path / "slf4j-simple.jar"),
                               str(tmp_path / "netty-codec.jar"))


def test_empty_zookeeper_home_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ZooKeeperNotInstalled) as err:
        find_zookeeper({"ZOOKEEPER_HOME": str(tmp_path), **fake_java(tmp_path)})
    message = str(err.value)
    assert f"ZOOKEEPER_HOME={tmp_path}" in message
    assert "sudo apt-get install zookeeper" in message
    assert "brew install zookeeper" in message


def test_nothing_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(install, "SEARCH_PATHS", [str(tmp_path / "zookeeper.jar"),
                                                 str(tmp_path / "libexec")])
    with pytest.raises(ZooKeeperNotInstalled) as err:
        find_zookeeper(fake_java(tmp_path))
    message = str(err.value)
    assert "sudo apt-get install zookeeper" in message
    assert "brew install zookeeper" in message
    assert "ZOOKEEPER_HOME" in message


def test_java_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "zookeeper.jar").write_bytes(b"")
    monkeypatch.setattr(install, "SEARCH_PATHS", [str(tmp_path / "zookeeper.jar")])
    with pytest.raises(ZooKeeperNotInstalled, match="JAVA_HOME"):
        find_zookeeper({"PATH": str(tmp_path)})


def test_ensemble_members_on_their_own_addresses(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install.ZooKeeperInstall(java="/bin/java", classpath=("/zk.jar",), source="test")
    monkeypatch.setattr(ensemble_module, "find_zookeeper", lambda: fake)
    hosts = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    prefixes = [["ip", "netns", "exec", f"ns{i}"] for i in range(3)]
    ensemble = ZooKeeperEnsemble(data_dir=str(tmp_path), hosts=hosts,
                                 command_prefixes=prefixes, jvm_flags=["-Xmx256m"])
    assert ensemble.hosts == ",".join(f"{h}:{ensemble.members[0].port}" for h in hosts)
    confs = [parse(member.render_config()) for member in ensemble.members]
    # Each binds its own address; the ports are the same on every machine.
    assert [c["clientPortAddress"] for c in confs] == hosts
    assert len({c["clientPort"] for c in confs}) == 1
    assert confs[0]["server.2"] == confs[2]["server.2"]
    assert confs[0]["server.2"].startswith("10.0.0.2:")
    assert ensemble.members[1].command_prefix == ("ip", "netns", "exec", "ns1")
    assert ensemble.members[1].jvm_flags == ("-Xmx256m",)
    with pytest.raises(ValueError, match="distinct"):
        ZooKeeperEnsemble(data_dir=str(tmp_path), hosts=["10.0.0.1", "10.0.0.1"])
    with pytest.raises(ValueError, match="one entry per member"):
        ZooKeeperEnsemble(data_dir=str(tmp_path), hosts=hosts, command_prefixes=prefixes[:2])
